"""`embedserve serve` and `embedserve plan`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import ServerConfig, config_fields, env_default, field_default, flag
from ..errors import ConfigError

logger = logging.getLogger("embedserve")

# Flags that may be given more than once (several models, keys, origins), joined with commas.
_REPEATABLE = ("model", "api_key", "allowed_origins")
_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per field of the configuration tree, its default from `EMBEDSERVE_<NAME>` if set."""
    for f in config_fields():
        default = env_default(f.name, field_default(f), str(f.type), f.metadata.get("choices"))
        name, env, help = flag(f.name), f"EMBEDSERVE_{f.name.upper()}", f.metadata.get("help", "")
        if f.type == "bool":
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]")
        elif f.name in _REPEATABLE:
            shown = "" if f.name == "api_key" else f"; default {default!r}"     # --help never shows a key
            p.add_argument(name, action="append", default=None,
                           help=f"{help}; repeat for several [env {env}, comma-separated{shown}]")
            p.set_defaults(**{f.name + "_default": default})
        else:
            choices = f.metadata.get("choices")
            typ = _TYPES.get(f.type, str)
            if choices and typ is str:        # argparse names the flag and lists the choices
                p.add_argument(name, choices=choices, default=default, help=f"{help} [env {env}; default {default!r}]")
            else:
                p.add_argument(name, type=typ, default=default, help=f"{help} [env {env}; default {default!r}]")


def config_from_args(args) -> ServerConfig:
    """The checked configuration tree from parsed flags (ConfigError naming the flag if not)."""
    values = {f.name: getattr(args, f.name) for f in config_fields()}
    for name in _REPEATABLE:
        given = getattr(args, name)
        values[name] = ",".join(given) if given else getattr(args, name + "_default")
    return ServerConfig.of(**values)


def register(subparsers) -> None:
    """Add `serve` and `plan`, each with every ServerConfig field as a flag."""
    s = subparsers.add_parser("serve", help="run the OpenAI-compatible server")
    add_config_flags(s)
    s.set_defaults(func=cmd_serve)
    p = subparsers.add_parser("plan", help="print the memory plan without loading weights")
    add_config_flags(p)
    p.set_defaults(func=cmd_plan)


def prepare(cfg: ServerConfig) -> tuple[list[str], list, tuple | None]:
    """Everything that can refuse the configuration, before any weight loads or port is bound:
    the compute paths set for this process, the index root writable, each model resolved and
    planned. Returns (lines to show, [(name, path)] of the embedders, (name, path, plan) of the
    decoder or None)."""
    from index.dense import set_search_threads
    from kernels import compute
    from ..memory_plan import embed_memory_plan
    from ..models.embedding_model import is_cross_encoder
    from ..models.registry import resolve_model

    if cfg.http.api_key_file:
        from ..api.auth import read_key_file
        read_key_file(cfg.http.api_key_file)          # ConfigError: unreadable, or no key in it
    compute.configure(cfg.paths)
    set_search_threads(cfg.index.faiss_threads)
    lines = ["compute paths: " + ", ".join(cfg.paths.lines()), _index_backend(cfg)]
    if cfg.paths.keep_freed_memory:
        from ..engine.malloc_tuning import keep_freed_memory
        why = keep_freed_memory()
        lines.append("malloc: freed batch memory kept in the process" if why is None else f"malloc: defaults ({why})")
    resolved, embed_bytes = [], 0
    for model in cfg.embed.models:
        name, path = resolve_model(model)
        plan = embed_memory_plan(path, cfg)
        embed_bytes += plan.total
        resolved.append((name, path))
        kind = "reranker" if is_cross_encoder(path) else "embedder"
        lines += [f"model {name} ({kind}, {path})", *plan.lines()]
    decoder = None
    if cfg.decode.enabled:
        from ..serve import plan_generator
        gname, gpath, gplan = plan_generator(cfg, embed_bytes=embed_bytes)
        lines += [f"generate model {gname} ({gpath})", *gplan.lines()]
        decoder = (gname, gpath, gplan)
    return lines, resolved, decoder


def _index_backend(cfg: ServerConfig) -> str:
    """Check where the indexes go (before the port binds) and say it in one line."""
    from ..paths import index_root
    ic = cfg.index
    if ic.index_url:
        from index.errors import ValidationError
        from index.pg.db import import_psycopg, redact
        try:
            import_psycopg()
        except ValidationError as exc:
            raise ConfigError(f"--index-url: {exc.message}") from None
        # the database may be down now: the server starts anyway, and index requests are 503 until it is back
        return f"index backend: postgres ({redact(ic.index_url)}, schema {ic.index_schema}, pool {ic.index_pool_size})"
    root = index_root(ic.index_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--index-dir {root}: cannot create it ({exc.strerror or exc}); "
                          "point it at a writable folder") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"--index-dir {root}: not writable by this user; point it at a writable folder")
    return f"index backend: local ({root})"


def cmd_serve(args) -> int:
    cfg = config_from_args(args)                # a bad setting is refused before torch is imported
    import torch
    import uvicorn
    from ..models.cross_encoder import load_model
    from ..serve import DrainingServer, build_app, load_generator

    from .logs import setup_logging
    setup_logging(cfg.http.log_level)
    lines, resolved, decoder = prepare(cfg)
    for line in lines:
        logger.info("%s", line)
    torch.set_num_threads(cfg.compute.threads or os.cpu_count() or 1)
    gen_loader = None
    if decoder is not None:
        gen_loader = lambda: load_generator(cfg, *decoder)  # noqa: E731
    http = cfg.http
    if http.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding to %s: the service is reachable from other machines%s", http.host,
                       "" if http.api_key or http.api_key_file else " and no --api-key is set")

    server_box = {}

    def on_load_error(exc):
        server_box["failed"] = True
        if "server" in server_box:
            server_box["server"].should_exit = True

    app = build_app(cfg, loader=lambda: [load_model(path, name=name, dtype=cfg.compute.dtype,
                                                    device=cfg.compute.device) for name, path in resolved],
                    on_load_error=on_load_error, gen_loader=gen_loader)
    # drained first (DrainingServer), so uvicorn's own grace period only closes idle connections
    server = DrainingServer(uvicorn.Config(app, host=http.host, port=http.port, log_level=http.log_level,
                                           access_log=False, timeout_graceful_shutdown=5),
                            state=app.state.embedserve, timeout=http.shutdown_timeout)
    server_box["server"] = server
    server.run()
    code = 1 if server_box.get("failed") else 0
    loader = app.state.embedserve.loader
    if loader is not None and loader.is_alive():
        # stopped while the models were still loading: nothing is served or written yet, and the
        # interpreter's teardown under a thread inside torch aborts the process ("terminate called
        # without an active exception", status 134) - so leave without it
        logger.info("stopped while the models were loading")
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    return code


def cmd_plan(args) -> int:
    cfg = config_from_args(args)
    lines, _, _ = prepare(cfg)
    print("\n".join(lines))
    return 0
