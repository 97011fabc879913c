"""k2fleet-test-double for the legacy KTransformers 0.3.2 server
(``python -m ktransformers.server.main``).

TEST DOUBLE.  Parses exactly the flags of ktransformers/server/args.py at v0.3.2
(same names, types and defaults as ``ArgumentParser.parse_args`` there; anything else
exits 2 like argparse does) and fails like the real server before it serves:

* ``--model_path``/``--model_dir``: a directory with ``config.json`` (the real one calls
  ``AutoConfig.from_pretrained`` on it);
* ``--gguf_path``: must exist and hold at least one ``*.gguf`` file (searched
  recursively, like ``GGUFLoader``), each starting with the ``GGUF`` magic and a
  version-3 header;
* ``--optimize_config_path`` (optional): an existing YAML rule list.

The real server loads the model before uvicorn listens, so the double opens its port
only after the simulated load (``K2FLEET_DOUBLE_STARTUP_SECONDS``).  Routes are the
real server's OpenAI ones: ``GET /v1/models`` (``{"data": [{"id": NAME, "name": NAME}]}``
with NAME = ``--model_name``, default ``DeepSeek-Coder-V2-Instruct`` from its config.yaml),
``POST /v1/chat/completions`` and ``POST /v1/completions`` (the request's ``model`` is not
checked, as in the real server), ``GET /api/tags`` (Ollama).  There is no ``/health``
(404): a health gate must use ``/v1/models``.  ``/v1/models`` entries also carry a
``metadata`` block naming the double and what it loaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from . import DOUBLE_NAME
from .common import (COMPLETION_ROUTES, EngineApp, EngineHandler, ModelError, Readiness, fail, gguf_files, log,
                     resolve_model, serve_http, startup_seconds, wait_for_shutdown)

ENGINE = "ktransformers"
VERSION = "0.3.2"
DEFAULT_MODEL_NAME = "DeepSeek-Coder-V2-Instruct"  # ktransformers/configs/config.yaml model.name
DEFAULT_PORT = 10002  # config.yaml server.port

# ktransformers/server/args.py @ v0.3.2, in its order: (flag, type). "bool" is argparse's
# type=bool (takes a value); "bool?" is BooleanOptionalAction (--x / --no-x).
FLAGS: tuple[tuple[str, Any], ...] = (
    ("--host", str), ("--port", int), ("--api_key", str), ("--ssl_keyfile", str), ("--ssl_certfile", str),
    ("--web", bool), ("--model_name", str), ("--model_dir", str), ("--model_path", str), ("--device", str),
    ("--architectures", str), ("--gguf_path", str), ("--optimize_config_path", str), ("--cpu_infer", int),
    ("--backend_type", str), ("--chunk_size", int), ("--max_batch_size", int), ("--max_new_tokens", int),
    ("--json_mode", bool), ("--healing", bool), ("--ban_strings", list), ("--gpu_split", str), ("--length", int),
    ("--rope_scale", float), ("--rope_alpha", float), ("--no_flash_attn", bool), ("--low_mem", bool),
    ("--experts_per_token", int), ("--load_q4", bool), ("--fast_safetensors", bool), ("--draft_model_dir", str),
    ("--no_draft_scale", bool), ("--modes", bool), ("--mode", str), ("--username", str), ("--botname", str),
    ("--system_prompt", str), ("--temperature", float), ("--smoothing_factor", float),
    ("--dynamic_temperature", str), ("--top_k", int), ("--top_p", float), ("--top_a", float), ("--skew", float),
    ("--typical", float), ("--repetition_penalty", float), ("--frequency_penalty", float),
    ("--presence_penalty", float), ("--response_chunk", int), ("--no_code_formatting", bool),
    ("--cache_8bit", bool), ("--cache_q4", bool), ("--ngram_decoding", bool), ("--print_timings", bool),
    ("--amnesia", bool), ("--batch_size", int), ("--cache_lens", int), ("--kvc2_config_dir", str),
    ("--log_dir", str), ("--log_file", str), ("--log_level", str), ("--backup_count", int), ("--db_type", str),
    ("--db_host", str), ("--db_port", str), ("--db_name", str), ("--db_pool_size", int), ("--db_database", str),
    ("--user_secret_key", str), ("--user_algorithm", str), ("--force_think", "bool?"),
    ("--use_cuda_graph", "bool?"), ("--web_cross_domain", bool), ("--file_upload_dir", str),
    ("--assistant_store_dir", str), ("--prompt_file", str), ("--sched_strategy", str), ("--page_size", str),
    ("--memory_gpu_only", str), ("--utilization_percentage", str), ("--cpu_memory_size_GB", str),
)
DEFAULTS = {"--host": "0.0.0.0", "--port": DEFAULT_PORT, "--model_name": DEFAULT_MODEL_NAME, "--cache_lens": 8192}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache.ai", description=f"Ktransformers ({DOUBLE_NAME})")
    for flag, kind in FLAGS:
        if kind == "bool?":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, type=bool, default=None)
        else:
            parser.add_argument(flag, type=kind, default=DEFAULTS.get(flag))
    return parser


def check_rules(path: Optional[str]) -> None:
    """The optimize rule file the real server opens as a YAML list of match/replace rules."""
    if path is None:
        return
    rules = Path(path)
    if not rules.is_file():
        raise ModelError(f"--optimize_config_path {path}: No such file")
    text = rules.read_text(encoding="utf-8", errors="replace")
    if "- match:" not in text:
        raise ModelError(f"--optimize_config_path {path}: not a list of optimize rules (no '- match:')")


class LegacyHandler(EngineHandler):
    """The legacy server's routes: no /health; /v1/models in its own shape; the request's
    ``model`` is not checked."""

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        app = self.app
        name = app.served_names[0]
        if path == "/v1/models":
            self.send_json(200, {"data": [{"id": name, "name": name, "metadata": {
                "double": DOUBLE_NAME, "engine": app.engine, "model_type": app.model.model_type,
                **app.metadata}}], "object": "list"})
        elif path == "/api/tags":
            self.send_json(200, {"models": [{"name": name, "modified_at": "", "size": 0, "digest": DOUBLE_NAME}]})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if path not in COMPLETION_ROUTES:
            self.send_json(404, {"detail": "Not Found"})
            return
        key = self.app.api_key
        if key and self.headers.get("Authorization", "").split()[-1:] != [key]:
            self.send_json(500, {"detail": "Internal Server Error"})  # the real one asserts
            return
        self.complete(path, lambda body: body.update(model=self.app.served_names[0]))


def make_app(a: argparse.Namespace) -> EngineApp:
    """Check what the real server loads before it serves (exit 1 naming the problem)."""
    model_dir = a.model_path or a.model_dir
    if not model_dir:
        raise ModelError("no --model_path/--model_dir (the real server reads config.json from it)")
    model = resolve_model(model_dir)
    if not model.local:
        raise ModelError(f"--model_path {model_dir} is not a local directory with config.json")
    if not a.gguf_path:
        raise ModelError("no --gguf_path")
    found = gguf_files(a.gguf_path)
    check_rules(a.optimize_config_path)
    return EngineApp(
        engine=ENGINE, served_names=[a.model_name], model=model, readiness=Readiness(ENGINE),
        api_key=a.api_key or None,
        metadata={"version": VERSION, "gguf_path": a.gguf_path, "gguf_files": len(found),
                  "optimize_config_path": a.optimize_config_path, "cache_lens": a.cache_lens,
                  "cpu_infer": a.cpu_infer})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        app = make_app(args)
    except ModelError as exc:
        fail(ENGINE, str(exc))
    log(ENGINE, f"{DOUBLE_NAME} pretending to be the KTransformers {VERSION} legacy server: "
                f"{args.model_path} + {app.metadata['gguf_files']} GGUF file(s) in {args.gguf_path}")
    time.sleep(startup_seconds())  # the real server loads the model before it listens
    http = serve_http(ENGINE, args.host, args.port, LegacyHandler, app)
    return wait_for_shutdown(ENGINE, [http.shutdown])


if __name__ == "__main__":
    sys.exit(main())
