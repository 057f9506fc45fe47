"""``python -m sglang.launch_server [flags]``: serve a model over HTTP (see ``--help``).

Without ``--model-path`` it serves the built-in default model: a tiny random-weight DeepSeek V4
that produces gibberish and exists to exercise the engine. With ``--nnodes N`` run it once per
node; node 0 serves HTTP, the others (``--node-rank`` > 0) run only their scheduler ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from sglang.srt.server_args import ServerArgsError, parse_args

    args = parse_args(argv)
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.managers.launcher import EngineStartupError
    from sglang.srt.managers.tokenizer import TokenizerLoadError

    try:
        if args.node_rank > 0:  # no HTTP here: this node runs its scheduler ranks only
            from sglang.srt.managers.worker_node import run_worker_node

            return run_worker_node(args)
        return launch_server(args)
    except (ServerArgsError, TokenizerLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineStartupError as exc:
        print(f"error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
