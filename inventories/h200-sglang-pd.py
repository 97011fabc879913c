"""Kimi-K2-Instruct on SGLang with prefill/decode disaggregation behind the router.

Seed: Moonshot's 4P12D H200 example (DP attention + DeepEP), at small counts on the
same code path: one prefill instance and one decode instance of 2 nodes each (TP16,
DP-attention 16, EP16), and a router host. Role data is in the groups below; fleet
data in ``group_data/h200-sglang-pd.py``. SGLang 0.5.23 spellings: ``--attn-dp-size``
for ``--dp-size N --enable-dp-attention``, ``--moe-a2a-backend deepep`` for
``--enable-deepep-moe``, ``--cuda-graph-bs-decode`` for ``--cuda-graph-bs``, the
router (``sglang_router.launch_router --pd-disaggregation``) for ``launch_lb``. The seed's
``--moe-dense-tp-size 1 --enable-dp-lm-head`` are not in ``k2_engine_args``: k2fleet renders them
with DP attention (and refuses them there).
"""

_COMMON = {
    "decode-log-interval": 1,
    "disable-radix-cache": True,
    "disable-shared-experts-fusion": True,
    "watchdog-timeout": 1000000,
    "enable-two-batch-overlap": True,
}
_ENV = {
    "MC_TE_METRIC": "true",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "10000000",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "100000",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "100000",
}

prefill = (
    [("prefill-0", {"ssh_hostname": "192.0.2.50"}), ("prefill-1", {"ssh_hostname": "192.0.2.51"})],
    {
        "k2_role": "prefill",
        "k2_tp": 16,
        "k2_dp": 16,
        "k2_attn_dp": True,
        "k2_ep": 16,
        "k2_gpu_memory_utilization": 0.85,
        "k2_env": _ENV,
        "k2_engine_args": _COMMON | {
            "chunked-prefill-size": 131072,
            "deepep-mode": "normal",
            "ep-dispatch-algorithm": "dynamic",
            "eplb-algorithm": "deepseek",
            "max-running-requests": 1024,
        },
    },
)

decode = (
    [("decode-0", {"ssh_hostname": "192.0.2.52"}), ("decode-1", {"ssh_hostname": "192.0.2.53"})],
    {
        "k2_role": "decode",
        "k2_tp": 16,
        "k2_dp": 16,
        "k2_attn_dp": True,
        "k2_ep": 16,
        "k2_gpu_memory_utilization": 0.8,
        "k2_env": _ENV | {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "480"},
        "k2_engine_args": _COMMON | {
            "context-length": 2176,
            "deepep-mode": "low_latency",
            "cuda-graph-bs": 480,
            "max-running-requests": 7680,
            "ep-num-redundant-experts": 16,
        },
    },
)

router = ([("router-0", {"ssh_hostname": "192.0.2.59"})], {"k2_role": "router"})
