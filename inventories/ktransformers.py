"""One CPU-heavy node with one H20: Kimi-K2-Instruct GGUF on KTransformers with the
AMX optimize rules.

Seed: Moonshot's deploy guidance, "KTransformers Deployment" (``--gguf_path`` +
``--optimize_config_path ...serve-amx.yaml``). That is the legacy KTransformers server,
so this inventory pins 0.3.2; with the default 0.7.2 pin k2fleet renders the
``kt-kernel`` + ``sglang-kt`` launch (``--kt-weight-path``, ``--kt-method LLAMAFILE``).
Config and tokenizer come from ``k2_model``, the weights from ``k2_gguf_repo``. Fleet
data: ``group_data/ktransformers.py``.
"""

kt_nodes = [("kt-0", {"ssh_hostname": "192.0.2.90"})]
