"""Run real DeepSpeed clients (DeepSpeedExamples scripts, DeepSpeed-Chat step 1) on zerodp, 2 gloo ranks.

    python tools/run_clients.py --examples PATH [--only cifar,bert,offload,chat] [--work DIR] [--quick]

``--only`` also takes ``CLIENT:LABEL`` items, which run only the runs of CLIENT whose label starts with
LABEL (``--only chat:s3`` runs DS-Chat's s3-bf16, s3-offload-bf16, s3-fp16, s3-offload-fp16; add
``chat:s0`` for the runs they are compared with).

PATH is a DeepSpeedExamples checkout or extracted tree, or a bare git directory of it (its HEAD is read
with ``git show``). Each client is copied into a work folder and changed only so:

- rename mode (cifar, bert, offload): its deepspeed imports are renamed by regex (``import deepspeed``
  -> ``import zerodp.deepspeed as deepspeed``, ``from deepspeed.x import y`` -> ``from
  zerodp.deepspeed.x import y``, ``import deepspeed.x as z`` -> ``import zerodp.deepspeed.x as z``);
- register mode (chat): its text is unchanged; zerodp is registered as ``deepspeed`` (``zerodp run``'s
  opt-in mechanism), because transformers imports ``deepspeed`` itself at ZeRO-3.

What they download is replaced (tools/client_harness, tools/run_clients_fixtures.py): a torchvision
stand-in with a synthetic CIFAR10 (cifar), synthetic wikitext lines and a word-level tokenizer (bert),
a tiny OPT built from a config plus DS-Chat's own ``local/jsonfile`` data files (chat). Each run is
``python -m torch.distributed.run --standalone --nproc-per-node 2 ds_launch.py SCRIPT ARGS`` (ds_launch
passes ``--local_rank`` as DeepSpeed's launcher does) with small sizes through the scripts' own
arguments. A sitecustomize records each rank's losses and its checkpoint saves/loads. Prints a table:
client, run, stage, dtype, status, steps, first/last loss (rank 0), whether the losses match the
client's reference run (stage 0, or its first variant), and saved/resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "client_harness"
sys.path.insert(0, str(HERE))

#: per-step loss tolerance against the reference run: |a - b| <= tol * max(1, |b|)
TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
TIMEOUT_S = 900

IMPORT_AS = re.compile(r"^(\s*)import deepspeed((?:\.\w+)*)(\s+as\s+\w+)", re.M)
IMPORT_SUB = re.compile(r"^(\s*)import deepspeed((?:\.\w+)+)\s*$", re.M)
IMPORT_TOP = re.compile(r"^(\s*)import deepspeed\s*$", re.M)
FROM = re.compile(r"^(\s*)from deepspeed((?:\.\w+)*) import", re.M)


def rename_imports(text: str) -> tuple[str, int]:
    """The deepspeed imports of a source text renamed to zerodp.deepspeed (line numbers kept); returns
    (text, number of imports renamed)."""
    n = 0
    for pattern, repl in (
        (IMPORT_AS, r"\1import zerodp.deepspeed\2\3"),
        (IMPORT_SUB, r"\1import zerodp.deepspeed\2; import zerodp.deepspeed as deepspeed"),
        (IMPORT_TOP, r"\1import zerodp.deepspeed as deepspeed"),
        (FROM, r"\1from zerodp.deepspeed\2 import"),
    ):
        text, k = pattern.subn(repl, text)
        n += k
    return text, n


@dataclass
class Run:
    client: str
    label: str
    stage: str
    dtype: str
    script: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    register: bool = False
    ref: str | None = None  # label of the run of the same client whose losses this one must match
    resume_of: str | None = None  # label of the run whose last save this one loads
    paths: list[str] = field(default_factory=list)  # put on PYTHONPATH after the harness folder
    fresh: list[Path] = field(default_factory=list)  # folders removed before each attempt
    result: dict = field(default_factory=dict)


# ---- getting the clients ---------------------------------------------------------------------------
CLIENT_PATHS = {
    "cifar": ["training/cifar"],
    "bert": ["training/HelloDeepSpeed"],
    "offload": ["training/offload_states"],
    "chat": ["applications/DeepSpeed-Chat/dschat", "applications/DeepSpeed-Chat/training/step1_supervised_finetuning"],
}


def _is_bare_git(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def examples_commit(path: Path) -> str:
    git_dir = ["--git-dir", str(path)] if _is_bare_git(path) else ["-C", str(path)]
    out = subprocess.run(["git", *git_dir, "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "(not a git tree)"


def copy_client(examples: Path, rel: str, dest: Path) -> None:
    """Copy ``rel`` (a folder of the examples tree; .py/.sh/.json/.txt files only) to ``dest/rel``."""
    keep = (".py", ".sh", ".json", ".txt")
    if _is_bare_git(examples):
        names = subprocess.run(
            ["git", "--git-dir", str(examples), "ls-tree", "-r", "--name-only", "HEAD", rel],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for name in (n for n in names if n.endswith(keep)):
            blob = subprocess.run(
                ["git", "--git-dir", str(examples), "show", f"HEAD:{name}"], capture_output=True, check=True
            ).stdout
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(blob)
        return
    shutil.copytree(
        examples / rel,
        dest / rel,
        dirs_exist_ok=True,
        ignore=lambda d, names: [n for n in names if Path(d, n).is_file() and not n.endswith(keep)],
    )


def rename_tree(root: Path) -> int:
    total = 0
    for py in root.rglob("*.py"):
        text, n = rename_imports(py.read_text())
        if n:
            py.write_text(text)
            total += n
    return total


# ---- the runs of each client -------------------------------------------------------------------------
def build_fixture(kind: str, out: Path, paths: list[str]) -> Path:
    """tools/run_clients_fixtures.py ``kind`` in a subprocess with ``paths`` first on PYTHONPATH (the
    client's own transformers writes the files it reads)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])]))
    subprocess.run(
        [sys.executable, str(HERE / "run_clients_fixtures.py"), kind, str(out)],
        env=env,
        check=True,
        capture_output=True,
    )
    return out


def cifar_runs(root: Path, quick: bool, paths: list[str]) -> list[Run]:
    """training/cifar/cifar10_deepspeed.py at --stage 0-3 x --dtype fp32/fp16/bf16; its own inline
    config (train_batch_size 16); 2 epochs of 96 synthetic images, loss printed every step."""
    script = root / "training/cifar/cifar10_deepspeed.py"
    env = {"ZERODP_CLIENT_SEED": "0", "ZERODP_CIFAR_TRAIN": "96", "ZERODP_CIFAR_TEST": "20"}
    runs = []
    for dtype in ("fp32",) if quick else ("fp32", "fp16", "bf16"):
        for stage in (0, 3) if quick else (0, 1, 2, 3):
            runs.append(
                Run(
                    "cifar",
                    f"s{stage}-{dtype}",
                    str(stage),
                    dtype,
                    script,
                    ["--epochs", "2", "--log-interval", "1", "--stage", str(stage), "--dtype", dtype],
                    dict(env),
                    ref=None if stage == 0 else f"s0-{dtype}",
                    paths=[*paths, str(root.parent / "harness" / "vision")],
                )
            )
    return runs


def bert_runs(root: Path, quick: bool, paths: list[str]) -> list[Run]:
    """training/HelloDeepSpeed/train_bert_ds.py (its config: ZeRO-1 + CPU optimizer offload) in bf16
    and fp16: 6 steps with a checkpoint every 3 (it saves again at exit, labelled 7), then a second run
    loading the experiment folder and going on to step 10 (its own --load_checkpoint_dir)."""
    folder = root / "training/HelloDeepSpeed"
    tok = build_fixture("roberta", folder / "synthetic_tokenizer", paths)
    small = [
        "--tokenizer",
        str(tok),
        "--num_layers",
        "2",
        "--num_heads",
        "2",
        "--h_dim",
        "32",
        "--ff_dim",
        "64",
        "--batch_size",
        "4",
        "--max_seq_length",
        "32",
        "--log_every",
        "1",
        "--checkpoint_every",
        "3",
    ]
    env = {"ZERODP_WIKITEXT_LINES": "64"}
    runs = []
    for dtype in ("bf16",) if quick else ("bf16", "fp16"):
        ck = folder / f"experiments_{dtype}"
        runs.append(
            Run(
                "bert",
                f"train-{dtype}",
                "1",
                dtype,
                folder / "train_bert_ds.py",
                ["--checkpoint_dir", str(ck), "--num_iterations", "7", "--dtype", dtype, *small],
                dict(env),
                fresh=[ck],
            )
        )
        runs.append(
            Run(
                "bert",
                f"resume-{dtype}",
                "1",
                dtype,
                folder / "train_bert_ds.py",
                [
                    "--load_checkpoint_dir",
                    f"{{exp:{ck}}}",
                    "--num_iterations",
                    "11",
                    "--dtype",
                    dtype,
                    "--log_every",
                    "1",
                ],
                dict(env),
                resume_of=f"train-{dtype}",
                paths=list(paths),
            )
        )
    return runs


def offload_runs(root: Path, quick: bool, paths: list[str]) -> list[Run]:
    """training/offload_states/offload_states.py (its config: ZeRO-3, Adam) per --dtype, all states and
    pinned/non-blocking and optim_states-only variants; hidden 64, 2 layers, 4 iterations."""
    script = root / "training/offload_states/offload_states.py"
    small = ["--hidden_dim", "64", "--nlayers", "2", "--iteration", "4", "--warmup", "1"]
    variants = {
        "all": [],
        "pinned-nb": ["--pin_memory", "--non_blocking"],
        "optim": ["--included_state", "optim_states"],
    }
    runs = []
    for dtype in ("fp32",) if quick else ("fp32", "fp16", "bf16"):
        torch_dtype = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}[dtype]
        for name, extra in variants.items():
            runs.append(
                Run(
                    "offload",
                    f"{name}-{dtype}",
                    "3",
                    dtype,
                    script,
                    [*small, "--dtype", torch_dtype, *extra],
                    {"ZERODP_CLIENT_SEED": "0"},
                    ref=None if name == "all" else f"all-{dtype}",
                    paths=list(paths),
                )
            )
    return runs


def chat_runs(root: Path, quick: bool, paths: list[str]) -> list[Run]:
    """DeepSpeed-Chat step1_supervised_finetuning/main.py at --zero_stage 0-3 x --dtype bf16/fp16 (and
    --offload at stage 3), unchanged, zerodp registered as deepspeed; a tiny OPT; 32 train / 8 eval
    records of its local/jsonfile format; saves with --output_dir."""
    from run_clients_fixtures import chat_jsonfile

    chat = root / "applications/DeepSpeed-Chat"
    chat_jsonfile(chat, train=32, evaluation=8)
    model = build_fixture("opt", root / "synthetic_opt", paths)
    step1 = chat / "training/step1_supervised_finetuning"
    runs = []
    for dtype in ("bf16",) if quick else ("bf16", "fp16"):
        stages: list[tuple[int, list[str]]] = [(s, []) for s in ((0, 3) if quick else (0, 1, 2, 3))]
        stages += [] if quick else [(3, ["--offload"])]
        for stage, extra in stages:
            label = f"s{stage}{'-offload' if extra else ''}-{dtype}"
            args = [
                "--data_path",
                "local/jsonfile",
                "--data_split",
                "10,0,0",
                "--model_name_or_path",
                str(model),
                "--per_device_train_batch_size",
                "2",
                "--per_device_eval_batch_size",
                "2",
                "--max_seq_len",
                "32",
                "--learning_rate",
                "1e-3",
                "--num_train_epochs",
                "1",
                "--zero_stage",
                str(stage),
                "--dtype",
                dtype,
                "--print_loss",
                "--output_dir",
                str(step1 / f"out_{label}"),
                "--data_output_path",
                str(step1 / f"data_files_{label}"),
                *extra,
            ]
            runs.append(
                Run(
                    "chat",
                    label,
                    str(stage),
                    dtype,
                    step1 / "main.py",
                    args,
                    {},
                    register=True,
                    paths=[*paths, str(chat)],
                    ref=None if stage == 0 and not extra else f"s0-{dtype}",
                )
            )
    return runs


CLIENTS = {"cifar": cifar_runs, "bert": bert_runs, "offload": offload_runs, "chat": chat_runs}


def parse_only(only: str) -> dict[str, list[str] | None]:
    """``--only``'s comma-separated ``CLIENT`` / ``CLIENT:LABEL`` items -> {client: label prefixes, or
    None for all its runs}, in the order given.

    Raises:
        ValueError: an unknown client, or an empty LABEL.
    """
    out: dict[str, list[str] | None] = {}
    for item in filter(None, only.split(",")):
        client, sep, prefix = item.partition(":")
        if client not in CLIENTS:
            raise ValueError(f"--only: unknown client {client!r}; known: {sorted(CLIENTS)}")
        if sep and not prefix:
            raise ValueError(f"--only {item!r}: give a label after ':' (e.g. chat:s3), or the client alone")
        prefixes = out.setdefault(client, [])
        if not sep or prefixes is None:
            out[client] = None
        else:
            prefixes.append(prefix)
    return out


def select_runs(runs: list[Run], only: dict[str, list[str] | None]) -> list[Run]:
    """The runs ``only`` (:func:`parse_only`) selects, in their order.

    Raises:
        ValueError: a label prefix that selects no run of its client (naming that client's runs).
    """
    for client, prefixes in only.items():
        labels = [r.label for r in runs if r.client == client]
        for prefix in prefixes or []:
            if not any(label.startswith(prefix) for label in labels):
                raise ValueError(f"--only {client}:{prefix} selects no run of {client}; its runs: {labels}")
    return [
        r
        for r in runs
        if r.client in only and (only[r.client] is None or any(r.label.startswith(p) for p in only[r.client] or []))
    ]


# ---- running and judging ------------------------------------------------------------------------------
def _resolve_args(run: Run) -> list[str]:
    """``{exp:DIR}`` -> the one experiment folder the earlier run made under DIR (bert)."""
    out = []
    for a in run.args:
        m = re.fullmatch(r"\{exp:(.*)\}", a)
        if m:
            found = sorted(p for p in Path(m.group(1)).glob("bert_pretrain.*") if p.is_dir())
            if len(found) != 1:
                raise RuntimeError(f"expected one experiment folder under {m.group(1)}, found {found}")
            a = str(found[0])
        out.append(a)
    return out


def launch(run: Run, work: Path, attempt: int = 1) -> tuple[int, str, Path]:
    """Run ``run`` on 2 gloo ranks; returns (exit code, log text, folder of the rank records)."""
    for folder in run.fresh:
        shutil.rmtree(folder, ignore_errors=True)
    out = work / "records" / f"{run.client}-{run.label}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", ZERODP_CLIENT_OUT=str(out), **run.env)
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([str(work / "harness"), *run.paths, *inherited])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(work / "harness" / "ds_launch.py"),
        *(["--register"] if run.register else []),
        str(run.script),
        *_resolve_args(run),
    ]
    try:
        proc = subprocess.run(cmd, cwd=run.script.parent, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = 124, f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {TIMEOUT_S} s"
    (work / "logs").mkdir(exist_ok=True)
    suffix = "" if attempt == 1 else f".attempt{attempt}"
    (work / "logs" / f"{run.client}-{run.label}{suffix}.log").write_text(" ".join(cmd) + "\n\n" + log)
    return rc, log, out


def first_error(log: str) -> str:
    """The first line naming an exception in a failed run's log (what a user would read first)."""
    for line in log.splitlines():
        if re.match(r"^\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)(:|$)", line):
            return re.sub(r"^\s*\[rank\d+\]:\s*", "", line).strip()[:300]
    tail = [ln for ln in log.splitlines() if ln.strip()]
    return (tail[-1] if tail else "no output")[:300]


def execute(run: Run, work: Path) -> None:
    try:
        rc, log, out = launch(run, work)
    except RuntimeError as e:  # its arguments name what an earlier run did not make (bert's resume)
        run.result.update(rc=-1, records=[], losses=[], status="not started", error=str(e))
        return
    if rc != 0 and "the ranks passed different arguments" in log:  # bert names its folder from each clock
        run.result["retried"] = first_error(log)
        run.env["ZERODP_CLIENT_CLOCK"] = str(int(time.time()))  # the same instant on both ranks
        rc, log, out = launch(run, work, attempt=2)
    records = []
    for r in range(2):
        f = out / f"rank{r}.json"
        records.append(json.loads(f.read_text()) if f.exists() else {"losses": [], "saves": [], "loads": []})
    run.result.update(rc=rc, records=records, losses=records[0]["losses"])
    retried = " (2nd try, clock pinned)" if "retried" in run.result else ""
    run.result["status"] = ("ok" if rc == 0 else f"FAIL rc={rc}") + retried
    if rc != 0:
        run.result["error"] = first_error(log)


def matches(run: Run, ref: Run | None) -> str:
    if ref is None:
        return "ref" if run.resume_of is None else ""
    a, b = run.result["losses"], ref.result["losses"]
    if not a or not b:
        return "n/a"
    if len(a) != len(b):
        return f"NO ({len(a)} vs {len(b)} steps)"
    tol = TOL[run.dtype]
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True))
    return f"yes ({worst:.1e})" if worst <= tol else f"NO ({worst:.1e} > {tol:g})"


def saved_resumed(run: Run, by_label: dict[str, Run]) -> str:
    recs = run.result.get("records", [])
    if run.resume_of is None:
        saves = [len(r["saves"]) for r in recs]
        return f"saved x{saves[0]}" if saves and saves[0] else "-"
    src = by_label[run.resume_of].result.get("records", [])
    ok = [
        bool(r["loads"]) and bool(s["saves"]) and r["loads"][0]["digest"] == s["saves"][-1]["digest"]
        for r, s in zip(recs, src, strict=False)
    ]
    if not recs or not recs[0]["loads"] or not src or not src[0]["saves"]:
        return "NOT resumed"
    step = recs[0]["loads"][0]["client_state"].get("checkpoint_step")
    trained = src[0]["saves"][-1]["digest"] != src[0].get("initial_digest")  # the check can fail
    return f"resumed step {step}, weights {'equal' if ok and all(ok) else 'DIFFER'}" + (
        "" if trained else " (saved = initial weights!)"
    )


def match_cell(run: Run, by_label: dict[str, Run]) -> str:
    """The "match ref" cell: :func:`matches` against the run's reference, "ref not run" when ``--only``
    left the reference out."""
    if run.ref is not None and run.ref not in by_label:
        return "ref not run"
    return matches(run, by_label.get(run.ref) if run.ref else None)


def table(runs: list[Run]) -> str:
    head = [
        "client",
        "run",
        "stage",
        "dtype",
        "status",
        "steps",
        "first loss",
        "last loss",
        "match ref",
        "saved/resumed",
    ]
    rows = []
    for run in runs:
        by_label = {r.label: r for r in runs if r.client == run.client}
        losses = run.result.get("losses", [])
        rows.append(
            [
                run.client,
                run.label,
                run.stage,
                run.dtype,
                run.result.get("status", "not run"),
                str(len(losses)),
                f"{losses[0]:.4f}" if losses else "-",
                f"{losses[-1]:.4f}" if losses else "-",
                match_cell(run, by_label),
                saved_resumed(run, by_label),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    errors = [f"- {r.client} {r.label}: {r.result['error']}" for r in runs if r.result.get("error")]
    errors += [f"- {r.client} {r.label}, 1st try: {r.result['retried']}" for r in runs if r.result.get("retried")]
    notes = ["", "Failures (first exception in the log) and retried first tries:", *errors] if errors else []
    return "\n".join(out + notes)


def prepare(examples: Path, work: Path, names: list[str]) -> dict[str, int]:
    """Copy the harness and the clients into ``work``; returns {client: imports renamed}."""
    shutil.copytree(HARNESS, work / "harness", dirs_exist_ok=True)
    renamed = {}
    for name in names:
        for rel in CLIENT_PATHS[name]:
            copy_client(examples, rel, work / "src")
        renamed[name] = 0 if name == "chat" else sum(rename_tree(work / "src" / rel) for rel in CLIENT_PATHS[name])
    return renamed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=Path, required=True, help="DeepSpeedExamples checkout, tree or bare git dir")
    p.add_argument(
        "--only",
        default=",".join(CLIENTS),
        help="comma-separated clients, or CLIENT:LABEL for the runs of CLIENT whose label starts with "
        "LABEL, e.g. chat:s0,chat:s3 (default: all)",
    )
    p.add_argument("--work", type=Path, help="work folder (default: a new temporary one, kept)")
    p.add_argument("--quick", action="store_true", help="fewer stages/dtypes (a smoke run)")
    p.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="CLIENT=DIR",
        help="put DIR first on CLIENT's PYTHONPATH (e.g. chat=DIR with transformers 4.x: DS-Chat imports "
        "transformers.modeling_utils.no_init_weights, which transformers 5 removed)",
    )
    args = p.parse_args(argv)
    try:
        only = parse_only(args.only)
    except ValueError as e:
        p.error(str(e))
    names = list(only)
    work = (args.work or Path(tempfile.mkdtemp(prefix="zerodp-clients-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    renamed = prepare(args.examples, work, names)
    print(f"DeepSpeedExamples {examples_commit(args.examples)}; work folder {work}")
    print(
        "imports renamed: "
        + ", ".join(f"{n} {k}" if n != "chat" else "chat 0 (unchanged, registered)" for n, k in renamed.items()),
        flush=True,
    )
    paths: dict[str, list[str]] = {}
    for item in args.path:
        client, sep, folder = item.partition("=")
        if not sep or client not in CLIENTS:
            p.error(f"--path {item!r}: expected CLIENT=DIR with CLIENT one of {sorted(CLIENTS)}")
        paths.setdefault(client, []).append(str(Path(folder).resolve()))
    try:
        runs = select_runs(
            [run for name in names for run in CLIENTS[name](work / "src", args.quick, paths.get(name, []))], only
        )
    except ValueError as e:
        p.error(str(e))
    for run in runs:
        execute(run, work)
        (work / "results.json").write_text(
            json.dumps(  # kept when a later run or the table fails
                [
                    {"client": r.client, "label": r.label, **{k: v for k, v in r.result.items() if k != "records"}}
                    for r in runs
                    if r.result
                ],
                indent=1,
            )
        )
        print(
            f"  {run.client} {run.label}: {run.result['status']} ({len(run.result['losses'])} steps)"
            + (f"  {run.result['error']}" if run.result.get("error") else ""),
            flush=True,
        )
    print(table(runs))
    return 0 if all(r.result.get("rc") == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
