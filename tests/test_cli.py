"""The command line: outputs, --json, and one clear sentence for each user mistake."""
import json

import pytest

from conftest import ROOT
from rhino.cli.main import main

BAD = ROOT / "tests" / "workloads" / "bad_inputs.py"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_prints_the_contract_line(capsys):
    code, out, _ = run(capsys, "check", str(ROOT / "examples" / "mlp.py"))
    assert code == 0
    assert out.startswith("check OK: steps=2 nodes=") and " opaque=0 max_abs_diff=" in out


def test_check_json(capsys):
    code, out, _ = run(capsys, "check", str(ROOT / "examples" / "mlp.py"), "--steps", "3", "--json")
    d = json.loads(out)
    assert code == 0 and d["ok"] is True and d["steps"] == 3
    assert {"ok", "max_abs_diff", "nodes", "opaque_ops"} <= d.keys()
    assert d["losses"] == d["eager_losses"] or max(abs(a - b) for a, b in zip(d["losses"], d["eager_losses"])) < 1e-5


def test_capture_writes_graph_atomically(capsys, tmp_path):
    out_file = tmp_path / "g.json"
    code, out, _ = run(capsys, "capture", str(ROOT / "examples" / "gpt.py"), "--out", str(out_file), "--json")
    d = json.loads(out)
    assert code == 0 and d["nodes"] > 100 and d["params"] > 0 and d["seconds"] > 0
    from rhino.ir import Graph, verify
    g = Graph.from_json(out_file.read_text())
    verify(g)
    assert len(g.nodes) == d["nodes"]
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]  # no temporary file left behind


def test_capture_on_meta(capsys):
    code, out, _ = run(capsys, "capture", str(ROOT / "tests" / "workloads" / "variants.py:huge_meta"), "--json")
    assert code == 0 and json.loads(out)["params"] > 6e9


def test_capture_into_missing_directory_fails_cleanly(capsys, tmp_path):
    code, _, err = run(capsys, "capture", str(ROOT / "examples" / "mlp.py"), "--out", str(tmp_path / "no" / "g.json"))
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize("func, phrase", [
    ("wrong_arity", "must return (model, optimizer, loss_fn, batch)"),
    ("not_a_module", "must be a torch.nn.Module"),
    ("batch_does_not_fit", "Check that the batch fits the model"),
    ("data_dependent", "bad_inputs.py:34"),
    ("data_dependent_generated", "bad_inputs.py:52"),   # the caller of the generated code, not "<string>:2"
    ("non_scalar_loss", "loss_fn must return a scalar"),
    ("raises", "cannot build the model"),
    ("foreign_optimizer", "not a parameter of the model"),
    ("batchnorm_cumulative", "give each BatchNorm a numeric momentum"),
    ("boolean_selection", "keep every element and mask the result instead of selecting"),
    ("adaptive_softmax", "compute the loss as F.nll_loss(asm.log_prob(input), target)"),
    ("complex_parameter", "parameter filt is complex, which Rhino does not support; hold its real and imaginary"),
    ("unsupported_optimizer", "re-evaluates the model several times inside step() through a closure"),
    ("no_such_function", "has no function 'no_such_function'"),
])
def test_bad_input_is_one_clear_sentence(capsys, func, phrase):
    code, out, err = run(capsys, "check", f"{BAD}:{func}")
    assert code == 2
    assert phrase in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0]


@pytest.mark.parametrize("strategy", ["dp=2,microbatches=2", "pp=2,microbatches=2"])
def test_a_batch_that_does_not_split_into_micro_batches_is_one_sentence(capsys, strategy):
    """Refused before any process starts (the ranks used to fail with a bare IndexError)."""
    code, _, err = run(capsys, "run", f"{BAD}:graph_batch", "--strategy", strategy)
    assert code == 2 and "the loss fails on a micro-batch (IndexError" in err and "use microbatches=1" in err
    assert "Traceback" not in err
    code, _, err = run(capsys, "run", f"{BAD}:bag_offsets", "--strategy", strategy)   # every micro-batch tried
    assert code == 2 and "the loss fails on a micro-batch (RuntimeError: offsets[0] has to be 0" in err
    assert "Traceback" not in err and "use microbatches=1" in err
    code, _, err = run(capsys, "run", f"{BAD}:sequence_first", "--strategy", strategy)
    assert code == 2 and "the step does not trace on a micro-batch" in err and "use microbatches=1" in err
    assert "Check that the batch fits" not in err  # capture's own advice gives way to the micro-batch one
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.multiprocess
def test_train_on_a_batch_that_does_not_split_into_micro_batches_says_why(capsys):
    """``rhino train`` builds the model deferred, so the loss is not tried first: the ranks' IndexError is
    turned into the same sentence."""
    code, _, err = run(capsys, "train", f"{BAD}:graph_batch", "--strategy", "dp=2,microbatches=2", "--steps", "1")
    assert code == 2 and "the loss fails on a micro-batch (IndexError" in err and "use microbatches=1" in err


def test_missing_file(capsys):
    code, _, err = run(capsys, "capture", "does/not/exist.py")
    assert code == 2 and "does not exist" in err


def test_bad_input_json(capsys):
    code, out, _ = run(capsys, "check", f"{BAD}:wrong_arity", "--json")
    d = json.loads(out)
    assert code == 2 and d["ok"] is False and "must return" in d["error"]


def test_check_refuses_meta_workload(capsys):
    code, _, err = run(capsys, "check", str(ROOT / "tests" / "workloads" / "variants.py:huge_meta"))
    assert code == 2 and "meta device" in err


@pytest.mark.multiprocess
def test_demo(capsys):
    code, out, _ = run(capsys, "demo")
    assert code == 0
    assert "check OK: steps=2" in out and "FLOPs" in out and "params" in out


def test_entry_leaves_at_once_while_a_solver_thread_runs():
    """``rhino`` (cli.main.entry) exits with main's code without interpreter shutdown while a layout search
    thread is still alive (shutdown would end it inside native code: SIGABRT), and normally otherwise."""
    import subprocess
    import sys
    code = ("import atexit, threading, time, rhino.cli.main as m\n"
            "from rhino.memory.layout import SOLVER_THREAD\n"
            "atexit.register(lambda: print('shutdown', flush=True))\n"
            "def fake(argv=None):\n"
            "    if {alive}:\n"
            "        threading.Thread(target=time.sleep, args=(60,), daemon=True, name=SOLVER_THREAD + 'x').start()\n"
            "    print('done', flush=True)\n"
            "    return 3\n"
            "m.main = fake\n"
            "m.entry()\n")
    for alive, shutdown in ((True, False), (False, True)):
        out = subprocess.run([sys.executable, "-c", code.format(alive=alive)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 3 and "done" in out.stdout, out.stderr[-1000:]
        assert ("shutdown" in out.stdout) == shutdown, (alive, out.stdout)


def test_dtype_choices_name_the_capture_dtypes():
    from rhino.capture import DTYPES
    from rhino.cli.common import DTYPE_NAMES
    assert set(DTYPE_NAMES) == set(DTYPES)


def test_layout_starts_without_torch():
    """``rhino layout`` and ``rhino memory``'s argument parsing import no torch: its ~1.3 s of start-up would
    come out of ``rhino layout --time-limit``, which counts from the process start."""
    import subprocess
    import sys
    code = ("import sys; from rhino.cli.main import _parser; _parser().parse_args(['layout', 'x.csv']); "
            "import rhino.memory.layout; print(sorted(m for m in ('torch', 'rhino.capture') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_written_files_are_atomic_with_plain_permissions(tmp_path):
    """``rhino.atomic``: a write that fails leaves the old file; a new file gets open()'s permissions, an
    existing file keeps its own (mkstemp's were 0600: a plan another user's job reads was unreadable)."""
    import os
    import stat
    from rhino.atomic import atomic_path, write_atomic
    target = tmp_path / "plan.json"
    write_atomic(target, "first")
    umask = os.umask(0)
    os.umask(umask)
    assert target.read_text() == "first" and stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    os.chmod(target, 0o640)
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    write_atomic(target, "second")
    assert target.read_text() == "second" and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_an_out_path_that_is_a_directory_is_one_sentence(capsys, tmp_path):
    """``--out DIR`` (export, capture, plan): one sentence and exit 2, not the rename's IsADirectoryError after
    the work was done; export refuses before reading the checkpoint, and no temporary file is left."""
    target = tmp_path / "here"
    target.mkdir()
    code, _, err = run(capsys, "export", str(tmp_path / "no-checkpoint"), "--out", str(target))
    assert code == 2 and f"'{target}' is a directory; give the path of a file to write" in err, err
    code, _, err = run(capsys, "capture", str(ROOT / "examples" / "mlp.py"), "--out", str(target))
    assert code == 2 and "is a directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"] and not list(target.iterdir())



def _unwritable_dir(tmp_path):
    """A directory in which no file can be created: a read-only folder, or (as root, who ignores permissions)
    sysfs; None where there is neither."""
    import os
    import tempfile
    from pathlib import Path
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    for d in (ro, Path("/sys")):
        try:
            fd, name = tempfile.mkstemp(dir=d)
        except OSError:
            return d
        os.close(fd)
        os.unlink(name)
    return None


@pytest.mark.parametrize("argv", [
    ["capture", "{mlp}", "--out", "{ro}/g.json"],
    ["plan", "{mlp}", "--cluster", "cpu:2", "--out", "{ro}/p.json"],
    ["plan", "{mlp}", "--cluster", "cpu:2", "--report", "{ro}/report"],
    ["profile", "--nproc", "1", "--out", "{ro}/profile.json"],
    ["run", "{mlp}", "--strategy", "dp=2", "--save-plan", "{ro}/p.json"],
    ["run", "{mlp}", "--strategy", "dp=2", "--emit", "{ro}/programs"],
    ["memory", "{mlp}", "--report", "{ro}/report"],
    ["train", "{mlp}", "--strategy", "dp=2", "--log", "{ro}/log.jsonl"],
    ["layout", "{csv}", "--out", "{ro}/out.csv"],
])
def test_an_unwritable_output_path_is_one_sentence_before_any_work(capsys, tmp_path, argv):
    """An output in a directory that takes no new file: one sentence and exit 2 before the capture, the search
    or the measurements (was a PermissionError traceback after the work, from the temporary file's mkstemp;
    rhino train's --log failed on the ranks)."""
    ro = _unwritable_dir(tmp_path)
    if ro is None:
        pytest.skip("no directory here refuses new files")
    csv = tmp_path / "b.csv"
    csv.write_text("id,lower,upper,size\n0,0,2,4\n")
    argv = [a.format(mlp=ROOT / "examples" / "mlp.py", ro=ro, csv=csv) for a in argv]
    for extra in ([], ["--json"]):
        code, out, err = run(capsys, *argv, *extra)
        assert code == 2 and "Traceback" not in err, err
        message = json.loads(out)["error"] if extra else err
        assert f"cannot create files in directory '{ro}'" in message and "choose a writable path" in message, message
        assert "capturing" not in err and "training" not in err


def test_a_file_where_an_output_directory_goes_is_one_sentence(capsys, tmp_path):
    """``--emit`` and ``--report`` name directories: a file there is refused before any work (``rhino run --emit
    FILE`` raised FileExistsError after the run's capture, ``rhino plan --report FILE`` after the search)."""
    f = tmp_path / "here.txt"
    f.write_text("keep")
    mlp = str(ROOT / "examples" / "mlp.py")
    for argv in (["run", mlp, "--strategy", "dp=2", "--emit", str(f)], ["plan", mlp, "--cluster", "cpu:2",
                 "--report", str(f)], ["plan", mlp, "--cluster", "cpu:2", "--report", str(f / "sub")],
                 ["memory", mlp, "--report", str(f)]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"'{f}' is a file" in err and "Traceback" not in err and "capturing" not in err, err
    assert f.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["here.txt"]


@pytest.mark.parametrize("content, phrase", [
    ("[]", "the plan file must hold one JSON object"),
    ('{"format": 1}', "the plan file lacks 'mesh', 'inputs', 'strategies'"),
    ('{"format": 1, "mesh": {"names": ["dp"], "sizes": ["2"]}, "inputs": {}, "strategies": {}}', 'the plan\'s "mesh" must be'),
    ('{"format": 1, "mesh": {"names": ["dp"], "sizes": [2]}, "inputs": [], "strategies": {}}', "'inputs' must map names"),
    ('{"format": 1, "mesh": {"names": ["dp"], "sizes": [2]}, "inputs": {"x": [0]}, "strategies": {}}', "placements as strings"),
    (b"\xff\xfe\x00garbage", "is not a text (JSON) file"),
    (None, "is a directory; give the JSON file rhino plan --out wrote"),
])
def test_a_corrupt_plan_file_is_one_sentence(capsys, tmp_path, content, phrase):
    """A plan file that is JSON but not a plan (a list, missing keys, a mesh of strings), binary, or a
    directory: one sentence before the capture for every command that reads plans (were AttributeError,
    KeyError, TypeError, UnicodeDecodeError, IsADirectoryError tracebacks)."""
    path = tmp_path / "plan.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    mlp = str(ROOT / "examples" / "mlp.py")
    for argv in (["estimate", mlp, "--cluster", "cpu:2"], ["run", mlp], ["memory", mlp], ["train", mlp]):
        code, out, err = run(capsys, *argv, "--plan", str(path))
        assert code == 2 and phrase in err and "Traceback" not in err and "capturing" not in err, (argv, err)
        assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("command", ["run", "train"])
@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_one_sentence(capsys, command, timeout):
    """``--timeout`` of run and train: refused before any process starts (a negative one reached the TCP
    store: DistNetworkError 'timed out after -5000ms' traceback)."""
    code, out, err = run(capsys, command, str(ROOT / "examples" / "mlp.py"), "--strategy", "dp=2", "--timeout", timeout)
    assert code == 2 and "--timeout must be a positive number of seconds" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, phrase", [
    (["check", "x.py", "--dtype", "float16"], "rhino check: argument --dtype: invalid choice: 'float16'"),
    (["run", "x.py"], "rhino run: one of the arguments --strategy --plan is required"),
    (["layout", "x.csv", "--time-limit", "abc"], "invalid float value: 'abc'"),
    (["memory", "x.py", "--level", "O3"], "invalid choice: 'O3'"),
])
def test_a_usage_error_with_json_is_json(capsys, argv, phrase):
    """With --json, argparse's own errors (a bad choice, a missing required flag) are the same
    ``{"ok": false, "error": ...}`` object on stdout as every other error (were usage text on stderr only);
    without --json they stay argparse's usage and message."""
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--json"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and json.loads(out.out) == {"ok": False, "error": json.loads(out.out)["error"]}
    assert phrase in json.loads(out.out)["error"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "" and phrase.split(": ", 1)[-1] in out.err and "usage:" in out.err


def test_estimate_schedule_flag_is_never_ignored(capsys, tmp_path):
    """``rhino estimate --schedule 1f1b`` on a GPipe plan priced GPipe (its 1f1b default meant "the plan's own"),
    and ``--schedule X`` beside a strategy's ``schedule=Y`` priced X under a header naming Y: the flag now
    replaces a plan's schedule and a disagreeing strategy string is one sentence."""
    from rhino.capture import capture, load_workload
    from rhino.sharding.presets import parse_strategy, preset_plan
    mlp = str(ROOT / "examples" / "mlp.py")
    plan = preset_plan(capture(load_workload(mlp)).graph, parse_strategy("pp=2,microbatches=4,schedule=gpipe"))
    (tmp_path / "p.json").write_text(plan.to_json())
    for flag, expected in (([], "gpipe"), (["--schedule", "1f1b"], "1f1b"), (["--schedule", "interleaved"], "interleaved")):
        code, out, _ = run(capsys, "estimate", mlp, "--cluster", "cpu:2", "--plan", str(tmp_path / "p.json"), "--json", *flag)
        assert code == 0 and json.loads(out)["schedule"] == expected, (flag, out)
    code, _, err = run(capsys, "estimate", mlp, "--cluster", "cpu:2", "--strategy", "pp=2,microbatches=4,schedule=gpipe",
                       "--schedule", "1f1b")
    assert code == 2 and "--schedule 1f1b and the strategy's schedule=gpipe disagree" in err
    code, out, _ = run(capsys, "estimate", mlp, "--cluster", "cpu:2", "--strategy", "pp=2,microbatches=4",
                       "--schedule", "gpipe", "--json")
    assert code == 0 and json.loads(out)["schedule"] == "gpipe"


def test_a_directory_given_as_an_input_file_says_so(capsys, tmp_path):
    """A directory where a workload or a job file goes is named as one ("does not exist" sent the user looking
    for a missing path)."""
    d = tmp_path / "model.py"
    d.mkdir()
    code, _, err = run(capsys, "capture", str(d))
    assert code == 2 and f"workload '{d}' is a directory; pass FILE[:FUNC] with a .py file" in err, err
    code, _, err = run(capsys, "launch", str(tmp_path))
    assert code == 2 and f"job file '{tmp_path}' is a directory" in err, err
