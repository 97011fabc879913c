"""``k2fleet bench`` and ``k2fleet eval`` planning (pure): which endpoints a fleet offers, the
engine's own benchmark client's argv for one concurrency point, the concurrency sweep, and
the lm-eval ``local-completions`` argv and task file for GSM8K from a local file (issue #23).

The clients run on the control machine (``--client``: the ``vllm`` executable, or a Python
that has vLLM; a Python that has SGLang; ``lm-eval`` or a Python that has lm-eval). The
endpoint's API key is never in argv: every client reads ``OPENAI_API_KEY`` (vLLM's
``benchmarks/lib/endpoint_request_func.py``; SGLang's ``bench_serving.get_auth_headers``;
lm-eval's ``local-completions``), each sending it as ``Authorization: Bearer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k2fleet.planning import engines
from k2fleet.planning.processes import Plan

# what the seeds swept (the vLLM K2-Thinking guide benchmarks one point; the sweep is issue #23's)
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_CONCURRENCY = 4096
MAX_POINTS = 16
# GSM8K 5-shot flexible-extract exact_match of Kimi-K2-Thinking on 8xH200 TP8 (the vLLM recipe's table)
SEED_GSM8K = 0.9416
SEED_GSM8K_STDERR = 0.0065
KEY_ENV = "OPENAI_API_KEY"  # read by `vllm bench serve` and by lm-eval's local-completions
BENCH_ENGINES = tuple(engines.having("bench_client"))  # each engine's own client (Engine.bench_argv)
NOT_WIRED = ("TRT-LLM's and KTransformers' benchmark clients are not wired in: `k2fleet bench` runs vLLM's "
             "`vllm bench serve` and SGLang's `python -m sglang.bench_serving`")


class BenchError(ValueError):
    """A bench/eval request that cannot be planned (one line)."""


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible base (``http://ADDRESS:PORT``) under a label for tables and plots."""

    label: str
    base: str


def endpoints(plan: Plan, replicas: bool = False, scheme: str = "http") -> list[Endpoint]:
    """The fleet's client endpoint (load balancer, router, or first server); with ``replicas``
    also every other serving process that answers chat on its own address and port;
    ``scheme``: ``https`` under ``k2_tls_cert_file`` (:func:`k2fleet.planning.api_front.scheme`).

    >>> from k2fleet.planning.processes import Health, HostPlan, Service
    >>> svc = lambda port: Service("vllm", [], health=Health(port=port))
    >>> p = Plan("inv", "vllm", "0.11.0", "venv", None, "/m",
    ...          {"a": HostPlan("a", "10.0.0.1", "serve", [svc(8000)]), "b": HostPlan("b", "10.0.0.2", "serve", [svc(8000)])})
    >>> [e.base for e in endpoints(p)], [e.label for e in endpoints(p, replicas=True)]
    (['http://10.0.0.1:8000'], ['endpoint', 'b'])
    """
    main = plan.endpoint()
    if main is None:
        raise BenchError(f"{plan.source}: the plan has no endpoint")
    out = [Endpoint("endpoint", f"{scheme}://{_host(main[0])}:{main[1]}")]
    if replicas:
        for host, svc in plan.services():
            if svc.health and svc.health.chat and svc.role == "serve":
                base = f"{scheme}://{_host(host.address)}:{svc.health.port}"
                if base not in {e.base for e in out}:
                    out.append(Endpoint(host.name, base))
    return out


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def parse_concurrency(text: str | None) -> tuple[int, ...]:
    """``--concurrency``: a comma-separated list of levels (each 1..4096, at most 16, sorted,
    duplicates dropped); None: the default sweep 1…256.

    >>> parse_concurrency("4,1,2,2"), parse_concurrency(None)[-1]
    ((1, 2, 4), 256)
    >>> parse_concurrency("0")
    Traceback (most recent call last):
    ...
    k2fleet.planning.bench_plan.BenchError: --concurrency: 0 is not between 1 and 4096
    """
    if text is None:
        return DEFAULT_CONCURRENCY
    levels = set()
    for word in text.split(","):
        word = word.strip()
        if not word.isdigit() or len(word) > 5:
            raise BenchError(f"--concurrency: {word[:20]!r} is not a whole number")
        if not 1 <= int(word) <= MAX_CONCURRENCY:
            raise BenchError(f"--concurrency: {int(word)} is not between 1 and {MAX_CONCURRENCY}")
        levels.add(int(word))
    if len(levels) > MAX_POINTS:
        raise BenchError(f"--concurrency: {len(levels)} levels; at most {MAX_POINTS}")
    return tuple(sorted(levels))


def prompts_for(concurrency: int, num_prompts: int | None) -> int:
    """Requests at one point: ``--num-prompts`` if given, else enough to fill the level ten
    times (at least 10, at most 1000).

    >>> prompts_for(1, None), prompts_for(256, None), prompts_for(256, 4)
    (10, 1000, 4)
    """
    if num_prompts is not None:
        return num_prompts
    return max(10, min(1000, 10 * concurrency))


def result_filename(label: str, concurrency: int, engine: str = "vllm") -> str:
    """Where one point's result goes (the label made file-name safe; SGLang appends JSON lines).

    >>> result_filename("gpu-0", 8), result_filename("a/b", 1, "sglang")
    ('gpu-0-c8.json', 'a_b-c1.jsonl')
    """
    return engines.get(engine).result_filename(label, concurrency)


def bench_argv(engine: str, client: str, endpoint: Endpoint, model: str, tokenizer: str, concurrency: int,
               num_prompts: int, input_len: int, output_len: int, result_dir: Path) -> list[str]:
    """The engine's benchmark client against ``endpoint`` at one concurrency level: a random
    dataset of ``input_len``/``output_len`` tokens, EOS ignored (every request produces
    ``output_len`` tokens), all requests at once with at most ``concurrency`` in flight, the
    result saved as ``result_dir/LABEL-cC.json``.

    >>> argv = bench_argv("vllm", "vllm", Endpoint("endpoint", "http://10.0.0.1:8000"), "moonshotai/Kimi-K2-Thinking",
    ...                   "/models/k2", 8, 80, 8000, 4000, Path("/out"))
    >>> " ".join(argv[:9])
    'vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --base-url http://10.0.0.1:8000'
    >>> argv[argv.index("--max-concurrency") + 1], argv[-1]
    ('8', 'endpoint-c8.json')
    """
    if not 1 <= num_prompts <= 100_000:
        raise BenchError(f"--num-prompts: {num_prompts} is not between 1 and 100000")
    for name, value in (("--input-len", input_len), ("--output-len", output_len)):
        if not 1 <= value <= 1_000_000:
            raise BenchError(f"{name}: {value} is not between 1 and 1000000")
    eng = engines.get(engine)
    if eng.bench_client is None:
        raise BenchError(f"engine {engine}: {NOT_WIRED}")
    return eng.bench_argv(client, endpoint.base, endpoint.label, model, tokenizer, concurrency, num_prompts,
                          input_len, output_len, result_dir)


# lm-eval

GSM8K_TASK = "k2fleet_gsm8k"


def gsm8k_task_yaml(dataset: Path, fewshot: Path | None = None) -> str:
    """lm-eval's ``gsm8k`` task (v3: 5-shot, ``Question: … Answer:``, strict and flexible
    ``####`` extraction) with the dataset read from local JSONL files (``question``/``answer``
    lines as in openai/gsm8k): ``dataset`` the test split, ``fewshot`` the train split the
    shots come from (default: the same file). Used with ``--include_path`` and
    ``HF_DATASETS_OFFLINE=1``: no Hub access."""
    import json

    files = {"train": str(fewshot or dataset), "test": str(dataset)}
    # json.dumps: valid YAML flow scalars for any path
    return "\n".join([
        f"task: {GSM8K_TASK}",
        "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{train: {json.dumps(files['train'])}, test: {json.dumps(files['test'])}}}}}",
        "output_type: generate_until",
        "training_split: train",
        "fewshot_split: train",
        "test_split: test",
        'doc_to_text: "Question: {{question}}\\nAnswer:"',
        'doc_to_target: "{{answer}}"',
        "metric_list:",
        "  - metric: exact_match",
        "    aggregation: mean",
        "    higher_is_better: true",
        "    ignore_case: true",
        "    ignore_punctuation: false",
        "    regexes_to_ignore:",
        '      - ","',
        '      - "\\\\$"',
        '      - "(?s).*#### "',
        '      - "\\\\.$"',
        "generation_kwargs:",
        "  until:",
        '    - "Question:"',
        '    - "</s>"',
        '    - "<|im_end|>"',
        "  do_sample: false",
        "  temperature: 0.0",
        "repeats: 1",
        "num_fewshot: 5",
        "filter_list:",
        '  - name: "strict-match"',
        "    filter:",
        '      - function: "regex"',
        '        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"',
        '      - function: "take_first"',
        '  - name: "flexible-extract"',
        "    filter:",
        '      - function: "regex"',
        "        group_select: -1",
        '        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"',
        '      - function: "take_first"',
        "metadata:",
        "  version: 3.0",
        "",
    ])


def eval_argv(client: str, base: str, model: str, include_dir: Path, output: Path, limit: int | None,
              num_concurrent: int = 32, max_gen_toks: int = 256, tokenizer: str | None = None) -> list[str]:
    """lm-eval ``local-completions`` against ``base``'s ``/v1/completions`` as the seeds ran it
    (``tokenized_requests=False``, 5-shot, batch size 1, temperature 0), on the local task of
    :func:`gsm8k_task_yaml` in ``include_dir``. ``client``: ``lm_eval``/``lm-eval``, or a Python
    that has lm-eval.

    >>> argv = eval_argv("lm-eval", "http://10.0.0.1:8000", "m", Path("/t"), Path("/o"), 3)
    >>> argv[:5], argv[argv.index("--limit") + 1]
    (['lm-eval', 'run', '--model', 'local-completions', '--model_args'], '3')
    """
    if limit is not None and not 1 <= limit <= 100_000:
        raise BenchError(f"--limit: {limit} is not between 1 and 100000")
    model_args = ",".join([
        f"model={model}", f"base_url={base}/v1/completions", "tokenized_requests=False",
        f"tokenizer_backend={'huggingface' if tokenizer else 'None'}", *([f"tokenizer={tokenizer}"] if tokenizer else []),
        f"num_concurrent={num_concurrent}", "max_retries=3", "timeout=3000", f"max_gen_toks={max_gen_toks}"])
    if "," in model or "," in base or (tokenizer and "," in tokenizer):
        raise BenchError("lm-eval's --model_args cannot carry a comma in the model name, URL or tokenizer path")
    python = Path(client).name.startswith("python")
    prefix = [client, "-m", "lm_eval"] if python else [client]
    return [*prefix, "run", "--model", "local-completions", "--model_args", model_args,
            "--tasks", GSM8K_TASK, "--include_path", str(include_dir), "--num_fewshot", "5", "--batch_size", "1",
            "--gen_kwargs", "temperature=0", "--output_path", str(output),
            *(["--limit", str(limit)] if limit is not None else [])]
