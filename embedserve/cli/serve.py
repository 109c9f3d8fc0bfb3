"""`embedserve serve` and `embedserve plan`."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import MISSING

from ..config import ServerConfig, config_fields, env_default

logger = logging.getLogger("embedserve")

# Flags that may be given more than once (several models, keys, origins), joined with commas.
_REPEATABLE = ("model", "api_key", "allowed_origins")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    for f in config_fields():
        default = f.default if f.default is not MISSING else None
        default = env_default(f.name, default, str(f.type))
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{f.metadata.get('help', '')} [env EMBEDSERVE_{f.name.upper()}]")
            continue
        if f.name in _REPEATABLE:
            shown = "" if f.name == "api_key" else f"; default {default!r}"     # --help never shows a key
            p.add_argument(flag, action="append", default=None,
                           help=f"{f.metadata.get('help', '')}; repeat for several "
                                f"[env EMBEDSERVE_{f.name.upper()}, comma-separated{shown}]")
            p.set_defaults(**{f.name + "_default": default})
            continue
        typ = {"int": int, "int | None": int, "float | None": float, "float": float}.get(f.type, str)
        p.add_argument(flag, type=typ, default=default,
                       help=f"{f.metadata.get('help', '')} [env EMBEDSERVE_{f.name.upper()}; default {default!r}]")


def config_from_args(args) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in config_fields()}
    for name in _REPEATABLE:
        given = getattr(args, name)
        values[name] = ",".join(given) if given else getattr(args, name + "_default")
    return ServerConfig(**values)


def register(subparsers) -> None:
    """Add `serve` and `plan`, each with every ServerConfig field as a flag."""
    s = subparsers.add_parser("serve", help="run the OpenAI-compatible server")
    add_config_flags(s)
    s.set_defaults(func=cmd_serve)
    p = subparsers.add_parser("plan", help="print the memory plan without loading weights")
    add_config_flags(p)
    p.set_defaults(func=cmd_plan)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args) -> int:
    import torch
    import uvicorn
    from ..memory_plan import embed_memory_plan
    from ..models.embedding_model import EmbeddingModel
    from ..models.registry import resolve_model
    from ..serve import DrainingServer, build_app, load_generator, plan_generator

    cfg = config_from_args(args)
    _setup_logging(cfg.log_level)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    resolved = [resolve_model(m) for m in cfg.models]
    embed_bytes = 0
    for name, path in resolved:
        plan = embed_memory_plan(path, cfg)
        embed_bytes += plan.total
        for line in plan.lines():
            logger.info("%s: %s", name, line)
    gen_loader = None
    if cfg.generate_model != "none":
        gname, gpath, gplan = plan_generator(cfg, embed_bytes=embed_bytes)
        for line in gplan.lines():
            logger.info(line)
        gen_loader = lambda: load_generator(cfg, gname, gpath, gplan)  # noqa: E731
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("binding to %s: the service is reachable from other machines%s", cfg.host,
                       "" if cfg.api_key or cfg.api_key_file else " and no --api-key is set")

    server_box = {}

    def on_load_error(exc):
        server_box["failed"] = True
        if "server" in server_box:
            server_box["server"].should_exit = True

    app = build_app(cfg, loader=lambda: [EmbeddingModel(path, name=name, dtype=cfg.dtype, device=cfg.device)
                                         for name, path in resolved],
                    on_load_error=on_load_error, gen_loader=gen_loader)
    # drained first (DrainingServer), so uvicorn's own grace period only closes idle connections
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           access_log=False, timeout_graceful_shutdown=5),
                            state=app.state.embedserve, timeout=cfg.shutdown_timeout)
    server_box["server"] = server
    server.run()
    return 1 if server_box.get("failed") else 0


def cmd_plan(args) -> int:
    from ..memory_plan import embed_memory_plan
    from ..models.registry import resolve_model

    cfg = config_from_args(args)
    embed_bytes = 0
    for model in cfg.models:
        name, path = resolve_model(model)
        plan = embed_memory_plan(path, cfg)
        embed_bytes += plan.total
        print(f"model {name} ({path})")
        for line in plan.lines():
            print(line)
    if cfg.generate_model != "none":
        from ..serve import plan_generator
        gname, gpath, gplan = plan_generator(cfg, embed_bytes=embed_bytes)
        print(f"generate model {gname} ({gpath})")
        for line in gplan.lines():
            print(line)
    return 0
