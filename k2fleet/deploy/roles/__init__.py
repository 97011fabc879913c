"""pyinfra @deploy roles used by deploys/kimi.py; thin wrappers over k2fleet logic."""
