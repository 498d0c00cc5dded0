"""The ``kvcompass`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompass", description="KVCompass: a KV-cache discovery plane for Internet-scale LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build views from patches across three regions and route prompts (the built-in default)")
    demo.add_argument("--prompts", type=int, default=24, help="prompts to cache and route (default 24)")
    demo.add_argument("--prompt-tokens", type=int, default=4096, help="tokens per prompt (default 4096)")
    demo.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvcompass.demo import DemoConfig, run_demo

        if args.prompts < 1 or args.prompt_tokens < 3072:
            parser.error("--prompts must be >= 1 and --prompt-tokens >= 3072 (the longest shared preamble)")
        run_demo(DemoConfig(prompts=args.prompts, prompt_tokens=args.prompt_tokens, seed=args.seed))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
