"""The command reference, docs/cli.md, generated from the `elastic` command's argparse parser.

    python -m elastic.cli_reference > docs/cli.md

Every command, argument, option, default and help text on the page comes from
`elastic.cli.parser()`, so an option the page documents is one the command takes (and
`elastic COMMAND --help` says the same). The sections after the reference (overrides, dry runs,
errors, ...) are the prose below.
tests/test_docs.py fails when the committed page differs from what this prints.
"""
from __future__ import annotations

import argparse

from elastic.cli import parser, subparsers

COMMAND = "python -m elastic.cli_reference > docs/cli.md"

INTRO = f"""\
<!-- Generated from the argparse parser in elastic/cli.py by `{COMMAND}`. Do not edit by hand. -->

# The `elastic` command

`elastic` (also `python -m elastic`) runs a job, shows its settings and reads a run's event log.
Exit codes: 0 done, 1 training failed, 2 bad input, before any work starts
([errors](#exit-codes-and-errors)). `elastic --version` prints the version; `elastic COMMAND --help`
prints what this page says about COMMAND.
"""


def _flags(action: argparse.Action) -> str:
    """How a user types it: `--set KEY=VALUE`, `--per-rank / --no-per-rank`, `JOB`."""
    if not action.option_strings:
        return action.metavar or action.dest.upper()
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(action.option_strings)
    flag = max(action.option_strings, key=len)
    return flag if action.nargs == 0 else f"{flag} {action.metavar or action.dest.upper()}"


def _arguments(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """What a command takes, less -h and --debug (which every command takes: said once, above)."""
    skip = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in p._actions if not isinstance(a, skip) and a.dest != "debug"]


def synopsis(name: str, p: argparse.ArgumentParser) -> str:
    """`elastic train JOB [--set KEY=VALUE ...] [--dry-run] ...`"""
    parts = [f"elastic {name}".strip()]
    for a in _arguments(p):
        if isinstance(a, argparse._VersionAction):
            continue
        text = _flags(a).split(" / ")[0]
        if isinstance(a, argparse._AppendAction):
            text += " ..."
        parts.append(text if not a.option_strings else f"[{text}]")
    if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
        parts.append("COMMAND")
    return " ".join(parts)


def _cell(text: str) -> str:
    """Help text as markdown table text: `<required>` must not read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _options(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in _arguments(p):
        what = _cell(a.help or "")
        if isinstance(a, argparse._AppendAction):
            what += " (repeatable)" if "repeatable" not in what else ""
        elif (a.default not in (None, False, [], argparse.SUPPRESS)
              and not isinstance(a, argparse._VersionAction)):
            what += f" (default: `{a.default}`)" if "default" not in what else ""
        rows.append(f"| `{_flags(a)}` | {what} |")
    return ["| argument | what it does |", "|---|---|", *rows] if rows else []


def commands() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, its parser, its one-line help) for every command that does something (no groups)."""
    top = parser()
    helps = {}
    for action in [a for _, sp in [("", top), *subparsers(top)] for a in sp._actions]:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                prog = action.choices[choice.dest].prog.removeprefix("elastic ")
                helps[prog] = choice.help or ""
    leaves = [(name, sp) for name, sp in subparsers(top)
              if not any(isinstance(a, argparse._SubParsersAction) for a in sp._actions)]
    return [(name, sp, helps.get(name, "")) for name, sp in leaves]


def render() -> str:
    top = parser()
    out = [INTRO, "| command | what it does |", "|---|---|"]
    cmds = commands()
    out += [f"| [`{synopsis(name, sp)}`](#elastic-{name.replace(' ', '-')}) | {_cell(what)} |"
            for name, sp, what in cmds]
    debug = next(a for a in top._actions if a.dest == "debug")
    out += ["", f"Every command also takes `--debug` (before or after the command's name): "
                f"{debug.help}. `-h` / `--help` prints a command's arguments.", ""]
    out += ["## Commands", ""]
    for name, sp, what in cmds:
        out += [f"### `elastic {name}`", "", _cell(what[:1].upper() + what[1:]) + ".", "",
                "```", synopsis(name, sp), "```", "", *_options(sp), ""]
    errors = ["| mistake | what `elastic` says |", "|---|---|",
              *(f"| {mistake} | `{says}` |" for mistake, says in ERRORS)]
    topics = TOPICS.replace("{example_error}", EXAMPLE_ERROR).replace("{errors}", "\n".join(errors))
    return "\n".join(out) + "\n" + topics


EXAMPLE_ERROR = ("elastic: invalid job config: scaling.num_wrkers: Extra inputs are not permitted "
                 "(got 3) (from --set scaling.num_wrkers=3)")
# (the mistake, the line `elastic` prints): the table of docs/cli.md#exit-codes-and-errors
ERRORS = [
    ("a setting that is wrong, or a key the job does not know",
     "elastic: invalid job config: scaling.num_workers: Input should be a valid integer, ..."),
    ("a storage scheme fsspec does not know (`storage_uri: foo://x`), in `train`, `--dry-run` and "
     "`config show` alike",
     "elastic: invalid job config: checkpoint.storage_uri: unknown storage scheme 'foo://': use "
     "file:///an/absolute/path, s3://bucket/prefix (s3fs), or another fsspec protocol ..."),
    ("a scheme whose package is not installed (`gcs://` without gcsfs)",
     "... storage scheme 'gcs://' needs the gcsfs package, which is not installed: "
     "pip install gcsfs"),
    ("storage that does not answer or take a write (`train`, `--dry-run`)",
     "elastic: checkpoint.storage_uri: storage s3://bucket/runs is not writable: write ... failed: "
     "EndpointConnectionError: ..."),
    ("a submitted Ray job whose storage lies in Ray's copy of its working directory "
     "([deploying](deploying.md#on-an-existing-ray-cluster))",
     "elastic: checkpoint.storage_uri: 'file://./runs' resolves to /tmp/ray/session_.../runs, "
     "inside the copy of the working directory that Ray unpacked for this job ..."),
    ("a run folder that does not exist, holds no log, or whose log cannot be read (`status`, "
     "`timeline`)",
     "elastic: no events in RUN: give a run folder ...`, `elastic: cannot read the event log of "
     "RUN: ...; check the path or URI, --storage-option and credentials`, `elastic: RUN is not an "
     "elastic event log ..."),
    ("a missing extra (`timeline --out` without matplotlib)",
     "elastic: drawing a timeline as a PNG needs matplotlib: pip install "
     "'elastic-trainer[plot]' ..."),
    ("a missing extra (`export --to model.safetensors`, or a `train.init_from` of one, without "
     "safetensors)",
     "elastic: writing a .safetensors file needs the safetensors package: pip install "
     "'elastic-trainer[safetensors]' ..."),
    ("`export` of a folder without a committed checkpoint, of a step that has none, or to a file "
     "of no known format ([models](models.md#the-model-out-elastic-export))",
     "elastic: RUN holds no committed checkpoint ...`, `elastic: RUN has no committed "
     "checkpoint of step 2 (...); committed: steps [3]`, `elastic: --to m.txt: name a "
     ".safetensors or a .pt (.pth, .bin) file"),
    ("a `--set` or `--storage-option` that is not `KEY=VALUE`",
     "elastic: --storage-option 'endpoint_url': expected KEY=VALUE (e.g. --storage-option "
     "endpoint_url=http://127.0.0.1:8333)"),
    ("an unknown command, or one without its argument",
     "elastic: argument COMMAND: invalid choice: 'trian' (choose from 'train', ...) (see elastic "
     "--help)"),
]

TOPICS = """\
## Overrides: `--set`

```
elastic train examples/job.yaml --set train.precision=bf16 --set scaling.num_workers=4
```

`KEY` is a dotted path into the job, `VALUE` is read as YAML, as it would be in the file: `8` a
number, `bf16` a string, `true` a bool, `null` none, `[1, 2]` a list,
`{endpoint_url: http://h:8333}` a mapping. A number indexes a list (`--set chaos.0.at_step=30`);
a missing section is created (`--set train.fsdp.replicate=2`). Overrides apply in order, so the
last one of a key wins; the file is not changed. The result is validated like the file, and an
error names the field and the override it came from:

```
$ elastic train job.yaml --set scaling.num_wrkers=3
{example_error}
```

Several bad fields are listed one per line under `elastic: invalid job config:`. An override that
sets a credential (`--set checkpoint.storage_options.secret=...`) is named in errors without its
value; better still, give credentials through the environment.

## A dry run

`elastic train JOB --dry-run` checks everything a run checks before it starts — the settings, the
model, optimizer and dataset functions (imported and called once: the dataset's length and
fingerprint, the strategy's plan on the meta device), that storage is writable, and that a resume
matches the run's checkpoints — prints the resolved job as YAML and starts nothing (no Ray, no
workers):

```
elastic train examples/job.yaml --set run.num_steps=50 --dry-run
```

## The job each run ran: `config.yaml`

Every start of a run writes its resolved job into the run folder as `config.yaml` (every default
filled in, the storage URI made absolute, credentials redacted), once the run's lease is its own.
The first line says which start wrote it. A run resumed with a changed job keeps the one it ran
before as `config.N.yaml` (N: the start that ran it), so no record is overwritten. If storage does
not take the file, the event log says so (`config_not_written`) and the run goes on.

## Reading a run from object storage: `--storage-option`

`elastic status` and `elastic timeline` read a run folder by path or URI. Options for its
filesystem (fsspec's, as in `checkpoint.storage_options`) are given as `KEY=VALUE`, the value read
as YAML:

```
elastic status s3://bucket/elastic/charlm --storage-option endpoint_url=http://127.0.0.1:8333
```

Credentials are better left to the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) or
the platform's identity than typed on a command line.

## Exit codes and errors

| exit | when |
|---|---|
| 0 | done |
| 1 | training failed (the run's summary, then `elastic: training failed: ...`) |
| 2 | a user error, before any work starts: one line on stderr that says what to fix |

The user errors, each one line naming the field, file or command and what to give instead:

{errors}

No traceback is printed for these; `--debug` (before or after the command) prints it above the
line. `tests/test_cli_errors.py` runs each of them as a separate process and checks the exit
code, the one line and the absence of a traceback.

## What these commands import

`elastic status`, `elastic timeline` and `elastic config` import neither torch nor Ray (the
package's names load on first use), so reading a run on a node that trains costs a fraction of a
second of CPU, not the seconds a torch import takes. A test checks it.
"""


if __name__ == "__main__":
    print(render(), end="")
