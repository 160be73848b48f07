"""The `elastic` command (also `python -m elastic`): a thin entry point over Trainer, the settings
and the event log readers. The benchmarks run from a checkout: `python -m benchmarks NAME`.

    elastic train JOB [--set KEY=VALUE ...] [--dry-run]   run a job (or check it and print it)
    elastic config show JOB [--set ...] | defaults | schema
    elastic status RUN [--json] [--storage-option KEY=VALUE ...]
    elastic timeline RUN [--out PNG] [--trace JSON] [--storage-option KEY=VALUE ...]
    elastic export RUN [--step N] --to model.safetensors|model.pt [--storage-option ...]

Exit codes: 0 done, 1 training failed, 2 bad input (a bad setting or argument, storage that does
not answer, a run folder with no readable log, a missing extra), as one line saying what to fix;
`--debug` adds the traceback. Commands that read settings or logs import neither torch nor Ray."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

SET_HELP = ("override a setting of the job file, KEY a dotted path, VALUE read as YAML "
            "(--set train.precision=bf16 --set scaling.num_workers=8); repeatable, applied in order")
STORAGE_OPTION_EXAMPLE = "endpoint_url=http://127.0.0.1:8333"
STORAGE_OPTION_HELP = ("an fsspec storage option for reading the run's folder, VALUE read as YAML "
                       f"(--storage-option {STORAGE_OPTION_EXAMPLE} --storage-option anon=true); "
                       "repeatable. Credentials are better left to the environment (AWS_ACCESS_KEY_ID, ...)")
DEBUG_HELP = "on an error, print its traceback too (a user error is otherwise one line)"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line that says what to fix: its usage block is one `--help` away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def add_debug(self) -> None:
        # SUPPRESS: a subcommand's own --debug must not reset one given before the subcommand
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help=DEBUG_HELP)


def parser() -> argparse.ArgumentParser:
    from elastic import __version__
    p = _Parser(prog="elastic", description="Fault-tolerant PyTorch training on Ray.")
    p.add_argument("--version", action="version", version=f"elastic {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    tr = sub.add_parser("train", help="run a job from a YAML file on the current Ray cluster (or a local one)")
    tr.add_argument("job", help="path to job.yaml")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    tr.add_argument("--dry-run", action="store_true",
                    help="check the job as a run would before it starts (settings, the model, optimizer and "
                         "dataset functions, the dataset, storage), print the resolved job, start nothing")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    cf = sub.add_parser("config", help="the settings: a job resolved, every default, the JSON schema")
    what = cf.add_subparsers(dest="what", required=True, metavar="WHAT")
    show = what.add_parser("show", help="the job as a run would take it: every default filled in, "
                                        "overrides applied, credentials redacted (YAML)")
    show.add_argument("job", help="path to job.yaml")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    what.add_parser("defaults", help="every setting with its default (YAML); <required> where there is none")
    what.add_parser("schema", help="the job's JSON schema (for editors and CI checks of job files)")
    tl = sub.add_parser("timeline", help="a run's timeline from its event log: a PNG, or a trace for Perfetto")
    tl.add_argument("events", metavar="RUN",
                    help="the run folder as a path or URI (s3://...), or its events.jsonl")
    tl.add_argument("--out", default=None, metavar="PNG",
                    help="PNG to write (default timeline.png, unless --trace is given alone); "
                         "needs the plot extra, elastic-trainer[plot]")
    tl.add_argument("--trace", default=None, metavar="JSON",
                    help="write a Chrome trace (trace-event JSON) to open in Perfetto or chrome://tracing: "
                         "the controller's states, checkpoints and events, one track per rank")
    tl.add_argument("--per-rank", action=argparse.BooleanOptionalAction, default=True,
                    help="one row per rank below the controller's (default); --no-per-rank: the controller's only")
    tl.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                    help=STORAGE_OPTION_HELP)
    st = sub.add_parser("status", help="where a run stands, from its event log: state, step, incidents, checkpoint")
    st.add_argument("run", help="the run folder as a path or URI (s3://...), or its events.jsonl")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    st.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                    help=STORAGE_OPTION_HELP)
    ex = sub.add_parser("export", help="write a run's model as a plain state dict (weights only, "
                                       "the model's own names, any layout merged): .safetensors "
                                       "or .pt")
    ex.add_argument("run", help="the run folder as a path or URI (s3://...), its checkpoints "
                                "folder, or a committed step folder")
    ex.add_argument("--step", type=int, default=None, metavar="N",
                    help="the committed checkpoint of step N (default: the newest)")
    ex.add_argument("--to", required=True, metavar="FILE",
                    help="the file to write, a path or URI: FILE.safetensors (needs the "
                         "safetensors extra, elastic-trainer[safetensors]) or FILE.pt "
                         "(torch.save); load it with model.load_state_dict")
    ex.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                    metavar="KEY=VALUE", help=STORAGE_OPTION_HELP)
    for _, sp in subparsers(p):
        sp.add_debug()
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # 'module:function' references in a job are resolved relative to where the user runs us,
    # as with `python -m`; console scripts do not put the working directory on sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from elastic.config.loading import ConfigError
    try:
        return {"train": _train, "config": _config, "timeline": _timeline, "status": _status,
                "export": _export}[args.cmd](args)
    except ConfigError as e:  # every user error: settings, storage, a run's log, a missing extra
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"elastic: {e}", file=sys.stderr)
        return 2


def subparsers(p: argparse.ArgumentParser,
                prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand's parser, depth first, named: "train", "config", "config show", ..."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                out.append((prefix + name, sp))
                out += subparsers(sp, prefix + name + " ")
    return out


def _config(args) -> int:
    import yaml
    if args.what == "show":
        from elastic.config.loading import dump_job, load_job
        print(dump_job(load_job(args.job, args.overrides)), end="")
    elif args.what == "defaults":
        from elastic.config.reference import defaults
        print(yaml.safe_dump(defaults(), sort_keys=False), end="")
    else:
        from elastic.config import JobConfig
        print(json.dumps(JobConfig.model_json_schema(), indent=2))
    return 0


def _storage_options(args) -> dict:
    from elastic.config.overrides import parse_options
    return parse_options(args.storage_options, "--storage-option", STORAGE_OPTION_EXAMPLE)


def _timeline(args) -> int:
    from elastic.config.secrets import redact_uri
    from elastic.observability.timeline import load_log, plot
    events = load_log(args.events, _storage_options(args))
    title = redact_uri(args.events)
    if args.trace:
        from elastic.observability.trace import load_steps, write_trace
        write_trace(events, args.trace, title=title, steps=load_steps(args.events, _storage_options(args)))
        print(f"wrote {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.out or not args.trace:
        out = args.out or "timeline.png"
        plot(events, out, title=title, per_rank=args.per_rank)
        print(f"wrote {out}")
    return 0


def _status(args) -> int:
    from elastic.observability.status import run_status
    return run_status(args.run, as_json=args.json, storage_options=_storage_options(args))


def _export(args) -> int:
    from elastic.checkpoint.export import export
    out = export(args.run, args.to, args.step, _storage_options(args))
    print(f"wrote {out['to']}: {out['tensors']} tensors, {out['numel']:,} parameters and buffers, "
          f"{out['bytes'] / 2 ** 20:.1f} MiB, from the checkpoint of step {out['step']} "
          f"({out['checkpoint']})")
    return 0


def _train(args) -> int:
    from elastic.config.loading import dump_job, load_job
    from elastic.trainer import Trainer, TrainingFailed
    trainer = Trainer(load_job(args.job, args.overrides))
    if args.dry_run:
        print(dump_job(trainer.job), end="")
        print(f"# elastic: {args.job} is valid; --dry-run: nothing started", file=sys.stderr)
        return 0
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
