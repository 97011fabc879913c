"""Checkpoint fetch, manifest, verification and overlay for k2fleet.

``verify.py`` is standard-library only and is copied to fleet hosts verbatim;
the other modules run on the control machine and use huggingface_hub.
"""
