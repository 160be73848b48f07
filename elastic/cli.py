"""`elastic train job.yaml`, `elastic status RUN` and `elastic timeline RUN`: a thin entry point over
Trainer and the event log readers. The benchmarks run from a checkout: `python -m benchmarks NAME`."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic", description="Fault-tolerant PyTorch training on Ray.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run a job from a YAML file on the current Ray cluster (or a local one)")
    tr.add_argument("job", help="path to job.yaml")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tl = sub.add_parser("timeline", help="draw a run's timeline (PNG) from its event log")
    tl.add_argument("events", help="path to a run's events.jsonl, or the run folder as a path or URI (s3://...)")
    tl.add_argument("--out", default="timeline.png", help="PNG to write")
    tl.add_argument("--per-rank", action=argparse.BooleanOptionalAction, default=True,
                    help="one row per rank below the controller's (default); --no-per-rank: the controller's only")
    st = sub.add_parser("status", help="where a run stands, from its event log: state, step, incidents, checkpoint")
    st.add_argument("run", help="the run folder as a path or URI (s3://...), or its events.jsonl")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)

    # 'module:function' references in a job are resolved relative to where the user runs us,
    # as with `python -m`; console scripts do not put the working directory on sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    if args.cmd == "train":
        return _train(args)
    if args.cmd == "timeline":
        from elastic.config.secrets import redact_uri
        from elastic.observability.timeline import load, plot
        events = load(args.events)
        if not events:
            print(f"elastic: no events in {redact_uri(args.events)}", file=sys.stderr)
            return 2
        plot(events, args.out, title=redact_uri(args.events), per_rank=args.per_rank)
        print(f"wrote {args.out}")
        return 0
    from elastic.observability.status import run_status
    return run_status(args.run, as_json=args.json)


def _train(args) -> int:
    from elastic.config import ConfigError
    from elastic.trainer import Trainer, TrainingFailed
    try:
        trainer = Trainer(args.job)
    except ConfigError as e:
        print(f"elastic: {e}", file=sys.stderr)
        return 2
    try:
        result = trainer.fit(progress=not args.no_progress)
    except TrainingFailed as e:
        print(e.result.summary(), file=sys.stderr)
        print(f"elastic: training failed: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
