"""``k2fleet bench``'s report on the control machine: each benchmark client's result JSON
(size-capped) → one point (throughput, TTFT, TPOT at one concurrency level), then one
combined JSON, a text table like the seeds' (the vLLM K2-Thinking guide's "Serving Benchmark
Result") and a PNG plot (matplotlib, Agg backend: three panels against concurrency, one line
per endpoint). ``k2fleet eval``: lm-eval's results JSON → the GSM8K score and its verdict."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_RESULT_BYTES = 16 * 1024 * 1024  # a result JSON holds per-request lists; 1,000 requests are ~1 MB


class ReportError(ValueError):
    """A result file that cannot be read as the client's result (one line)."""


@dataclass(frozen=True)
class Point:
    endpoint: str
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # input+output tok/s
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float


def read_json_capped(path: Path, cap: int = MAX_RESULT_BYTES) -> dict:
    """``path``'s JSON object, refused when larger than ``cap`` bytes or not an object."""
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise ReportError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > cap:
        raise ReportError(f"{path}: larger than {cap} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: not a JSON object")
    return doc


def _num(doc: dict, key: str, path: Path) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReportError(f"{path}: {key} missing or not a finite number")
    return float(value)


def vllm_point(doc: dict, endpoint: str, concurrency: int, path: Path = Path("result")) -> Point:
    """One point from ``vllm bench serve --save-result``'s JSON.

    >>> d = dict(completed=4, failed=0, duration=2.0, request_throughput=2.0, output_throughput=64.0,
    ...          total_token_throughput=96.0, mean_ttft_ms=10, median_ttft_ms=9, p99_ttft_ms=20,
    ...          mean_tpot_ms=5, median_tpot_ms=5, p99_tpot_ms=6, max_concurrency=2)
    >>> vllm_point(d, "endpoint", 2).output_throughput
    64.0
    """
    n = {k: _num(doc, k, path) for k in ("completed", "duration", "request_throughput", "output_throughput",
                                          "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                          "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")}
    failed = doc.get("failed", 0)
    if doc.get("max_concurrency") not in (None, concurrency):
        raise ReportError(f"{path}: max_concurrency {doc.get('max_concurrency')!r}, expected {concurrency}")
    return Point(endpoint, concurrency, int(n["completed"]), int(failed) if isinstance(failed, int) else 0,
                 n["duration"], n["request_throughput"], n["output_throughput"], n["total_token_throughput"],
                 n["mean_ttft_ms"], n["median_ttft_ms"], n["p99_ttft_ms"],
                 n["mean_tpot_ms"], n["median_tpot_ms"], n["p99_tpot_ms"])


def sglang_point(doc: dict, endpoint: str, concurrency: int, num_prompts: int, path: Path = Path("result")) -> Point:
    """One point from ``python -m sglang.bench_serving --output-file``'s last JSON line (its
    keys: ``total_throughput`` for input+output tok/s; no failure count: requests not completed).

    >>> d = dict(completed=3, duration=2.0, request_throughput=1.5, output_throughput=48.0, total_throughput=90.0,
    ...          mean_ttft_ms=10, median_ttft_ms=9, p99_ttft_ms=20, mean_tpot_ms=5, median_tpot_ms=5, p99_tpot_ms=6)
    >>> p = sglang_point(d, "endpoint", 2, 4); (p.failed, p.total_token_throughput)
    (1, 90.0)
    """
    n = {k: _num(doc, k, path) for k in ("completed", "duration", "request_throughput", "output_throughput",
                                          "total_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                          "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")}
    return Point(endpoint, concurrency, int(n["completed"]), max(0, num_prompts - int(n["completed"])), n["duration"],
                 n["request_throughput"], n["output_throughput"], n["total_throughput"],
                 n["mean_ttft_ms"], n["median_ttft_ms"], n["p99_ttft_ms"],
                 n["mean_tpot_ms"], n["median_tpot_ms"], n["p99_tpot_ms"])


def read_last_json_line(path: Path, cap: int = MAX_RESULT_BYTES) -> dict:
    """The last JSON object line of a JSONL file (SGLang appends one per run), size-capped."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ReportError(f"{path}: {exc.strerror or exc}") from None
    if size > cap:
        raise ReportError(f"{path}: larger than {cap} bytes")
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise ReportError(f"{path}: empty")
    try:
        doc = json.loads(lines[-1])
    except ValueError as exc:
        raise ReportError(f"{path}: last line not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: not a JSON object")
    return doc


COLUMNS = (("ENDPOINT", "endpoint", "{}"), ("CONC", "concurrency", "{}"), ("OK", "completed", "{}"),
           ("FAIL", "failed", "{}"), ("REQ/S", "request_throughput", "{:.2f}"),
           ("OUT TOK/S", "output_throughput", "{:.2f}"), ("TOTAL TOK/S", "total_token_throughput", "{:.2f}"),
           ("MEAN TTFT ms", "mean_ttft_ms", "{:.2f}"), ("MEDIAN TTFT ms", "median_ttft_ms", "{:.2f}"),
           ("P99 TTFT ms", "p99_ttft_ms", "{:.2f}"), ("MEAN TPOT ms", "mean_tpot_ms", "{:.2f}"),
           ("MEDIAN TPOT ms", "median_tpot_ms", "{:.2f}"), ("P99 TPOT ms", "p99_tpot_ms", "{:.2f}"))


def format_table(points: list[Point]) -> str:
    """One row per endpoint and concurrency level, the seeds' metrics as columns.

    >>> p = Point("endpoint", 1, 4, 0, 1.0, 4.0, 128.0, 160.0, 12.5, 12.0, 20.0, 3.25, 3.0, 4.0)
    >>> format_table([p]).splitlines()[1].split()[:6]
    ['endpoint', '1', '4', '0', '4.00', '128.00']
    """
    rows = [tuple(c[0] for c in COLUMNS)]
    rows += [tuple(fmt.format(getattr(p, attr)) for _, attr, fmt in COLUMNS) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"


def report_document(points: list[Point], meta: dict) -> dict:
    return {**meta, "points": [asdict(p) for p in points]}


def write_plot(points: list[Point], path: Path, title: str = "") -> Path:
    """A PNG of output throughput, mean TTFT and mean TPOT against concurrency (log2 axis),
    one line per endpoint."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = (("output_throughput", "output tokens/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
              ("mean_tpot_ms", "mean TPOT (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    by_endpoint: dict[str, list[Point]] = {}
    for p in points:
        by_endpoint.setdefault(p.endpoint, []).append(p)
    for ax, (attr, label) in zip(axes, panels):
        for name, series in by_endpoint.items():
            series = sorted(series, key=lambda p: p.concurrency)
            ax.plot([p.concurrency for p in series], [getattr(p, attr) for p in series], marker="o", label=name)
        ax.set_xscale("log", base=2)
        levels = sorted({p.concurrency for p in points})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


# lm-eval


@dataclass(frozen=True)
class Score:
    task: str
    filter: str
    value: float
    stderr: float | None
    samples: int | None


def gsm8k_score(doc: dict, task: str, filter_name: str = "flexible-extract") -> Score:
    """The ``exact_match`` of ``filter_name`` from lm-eval's results JSON.

    >>> d = {"results": {"t": {"exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.1}},
    ...      "n-samples": {"t": {"effective": 4}}}
    >>> gsm8k_score(d, "t")
    Score(task='t', filter='flexible-extract', value=0.5, stderr=0.1, samples=4)
    """
    res = (doc.get("results") or {}).get(task)
    if not isinstance(res, dict):
        raise ReportError(f"lm-eval's results have no task {task}")
    value = res.get(f"exact_match,{filter_name}")
    if not isinstance(value, (int, float)):
        raise ReportError(f"lm-eval's results for {task} have no exact_match,{filter_name}")
    stderr = res.get(f"exact_match_stderr,{filter_name}")
    samples = ((doc.get("n-samples") or {}).get(task) or {}).get("effective")
    return Score(task, filter_name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None,
                 samples if isinstance(samples, int) else None)


def verdict(score: Score, expect: float) -> tuple[bool, str]:
    """Passes when the score is at least ``expect`` minus its standard error.

    >>> verdict(Score("t", "flexible-extract", 0.94, 0.0065, 1319), 0.9416)
    (True, 'gsm8k 5-shot exact_match (flexible-extract): 0.9400 ± 0.0065 on 1319 samples; expected ≥ 0.9416 − stderr: ok')
    >>> verdict(Score("t", "flexible-extract", 0.5, None, 3), 0.9416)[0]
    False
    """
    err = score.stderr if score.stderr is not None and math.isfinite(score.stderr) else 0.0
    ok = score.value >= expect - err
    line = (f"gsm8k 5-shot exact_match ({score.filter}): {score.value:.4f} ± {err:.4f}"
            + (f" on {score.samples} samples" if score.samples else "")
            + f"; expected ≥ {expect:.4f} − stderr: {'ok' if ok else 'BELOW'}")
    return ok, line
