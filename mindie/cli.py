"""`mindie serve [MODEL] [--config config.json] [--host H] [--port P] [--api-key KEY] ...`,
`mindie coordinator --config ms_coordinator.json` (the prefill/decode coordinator),
`mindie cluster --prefill N --decode M [--model ...]` (a PD cluster on this machine)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from mindie.config_keys import ConfigError
from mindie.server.config import ServerSettings
from mindie.structured.reasoning_parser import REASONING_PARSERS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindie", description="A MindIE-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (MindIE, OpenAI, TGI, vLLM and Triton APIs)")
    serve.add_argument("model", nargs="?", help="a GGUF file or a Hugging Face directory (default: the embedded "
                       "SmolLM2-135M-Instruct, or ModelConfig.modelWeightPath of --config)")
    serve.add_argument("--config", help="a MindIE config.json; the flags below override it")
    serve.add_argument("--host", help="business-plane address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="business-plane port (default 1025)")
    serve.add_argument("--management-host", help="management and metrics address (default 127.0.0.2)")
    serve.add_argument("--management-port", type=int, help="management-plane port (default 1026)")
    serve.add_argument("--metrics-port", type=int, help="metrics-plane port (default 1027)")
    serve.add_argument("--api-key", default=os.environ.get("MINDIE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every business route (or env MINDIE_API_KEY)")
    serve.add_argument("--served-model-name", "--model-name", dest="model_name",
                       help="the name clients use in `model` and in /v2/models/{name} (default: ModelConfig.modelName "
                       "of --config, else the model's own: a GGUF file's general.name or file name, a Hugging Face "
                       "directory's name)")
    serve.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                       help="activation / KV-cache dtype (default auto: bfloat16 only on CPUs with AVX512-BF16)")
    serve.add_argument("--quantization", choices=["auto", "none", "q8_0", "q4_0"],
                       help="auto (default): a GGUF keeps its formats, a Hugging Face model stays dense; none: "
                       "everything dense (exact); q8_0 / q4_0: quantize a Hugging Face model at load")
    serve.add_argument("--activation-bits", type=int, choices=[16, 8],
                       help="the quantized path's activations: 16 (default; two int8 planes, about 15 bits: "
                       "generated tokens keep float32's top-1) or 8 (one plane, as llama.cpp: faster at batched "
                       "decode and prompts, the top-1 token moves at a few percent of positions)")
    serve.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS),
                       help="split <think>...</think> out of chat replies into reasoning_content: auto (default) "
                       "for a Qwen3 model whose tokenizer has those tokens, qwen3 for any model that has them, "
                       "none never")
    serve.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="read images named by a local path only under DIR (default: no local path is read)")
    serve.add_argument("--allow-private-media-urls", action="store_true", default=None,
                       help="let image URLs name loopback and link-local hosts (refused by default)")
    coordinator = sub.add_parser("coordinator", help="the prefill/decode coordinator (MindIE MS ms_coordinator)")
    coordinator.add_argument("--config", required=True, help="an ms_coordinator.json, with the P/D `instances`")
    from mindie.coordinator.cluster import add_arguments

    add_arguments(sub.add_parser("cluster", help="a prefill/decode cluster on this machine: the coordinator on "
                                 "127.0.0.1 and the instances on 127.0.0.2, 127.0.0.3, ..."))
    return parser


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    settings = ServerSettings.from_file(args.config) if args.config else ServerSettings()
    media = settings.media
    if args.allowed_local_media_path is not None:
        media = dataclasses.replace(media, allowed_local_path=os.path.abspath(args.allowed_local_media_path))
    if args.allow_private_media_urls:
        media = dataclasses.replace(media, allow_private_urls=True)
    return settings.with_overrides(media=media,
        model_path=args.model, host=args.host, port=args.port, management_host=args.management_host,
        management_port=args.management_port, metrics_port=args.metrics_port, api_key=args.api_key,
        model_name=args.model_name, dtype=args.dtype, quantization=args.quantization,
        activation_bits=args.activation_bits,
        reasoning_parser=args.reasoning_parser,
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "coordinator":
        _coordinator(args.config)
        return
    if args.command == "cluster":
        from mindie.coordinator.cluster import main as cluster_main

        cluster_main(args)
        return
    try:
        settings = settings_from_args(args)
    except (ConfigError, OSError) as exc:
        sys.exit(f"mindie: configuration error: {exc}")
    for port_name in ("port", "management_port", "metrics_port"):
        port = getattr(settings, port_name)
        if not 1024 <= port <= 65535:
            sys.exit(f"mindie: configuration error: --{port_name.replace('_', '-')} must be in [1024, 65535], "
                     f"got {port}")
    if settings.ignored:
        print(f"note: these config keys have no effect on this server: {', '.join(settings.ignored)}",
              file=sys.stderr)
    from mindie.server.launcher import run

    try:
        run(settings)
    except ConfigError as exc:  # a limit that does not fit the model, known once it is loaded
        sys.exit(f"mindie: configuration error: {exc}")


def _coordinator(path: str) -> None:
    from mindie.coordinator.config import CoordinatorConfig
    from mindie.coordinator.launcher import run as run_coordinator

    try:
        config = CoordinatorConfig.from_file(path)
    except (ConfigError, OSError) as exc:
        sys.exit(f"mindie coordinator: configuration error: {exc}")
    if not config.instances:
        sys.exit("mindie coordinator: configuration error: `instances` lists no P or D instance")
    if config.ignored:
        print(f"note: these config keys have no effect on this coordinator: {', '.join(config.ignored)}",
              file=sys.stderr)
    run_coordinator(config)


if __name__ == "__main__":
    main()
