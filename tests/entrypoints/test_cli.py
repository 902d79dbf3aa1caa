"""The `mmkit` command as a subprocess on real files (mechanics, on a tiny checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import get_llm, make_image


# The interrupted evals: 20 items are done when the run is killed, the rerun does the rest (the
# more items, the longer the rerun; 80 leave 60 for it, still far more than one step's work).
NUM_BIG = 80


def _env() -> dict:
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE")


def mmkit(*args, timeout=300, **kwargs):
    return subprocess.run([sys.executable, "-m", "mmkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), **kwargs)


def _sigint_default():
    # A child inherits an ignored SIGINT (SIG_IGN) from its parent, and Python then raises no
    # KeyboardInterrupt: both interrupt tests once saw their child run to the end (status 0) in a
    # full run. They ask what a Ctrl-C in a terminal does, where SIGINT is SIG_DFL: set, not inherited.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args, **kwargs) -> subprocess.Popen:
    """`mmkit ARGS` running in the background (pipes for its output unless kwargs say otherwise)."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen([sys.executable, "-m", "mmkit", *args], env=_env(), preexec_fn=_sigint_default,
                            **kwargs)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "img").mkdir()
    for i in range(4):
        make_image(i).save(root / "img" / f"{i}.png")
    (root / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rows = []
    for i in range(60):
        rows.append({"image": f"img/{i % 4}.png", "question": f"Question {i}?", "answer": ["x", "y"] if i % 2 else "z",
                     "type": "even" if i % 2 == 0 else "odd"})
    rows.append({"image": "img/missing.png", "question": "Where?", "answer": "nowhere", "type": "odd"})
    rows.append({"image": "img/broken.png", "question": "Broken?", "answer": "yes", "type": "even", "id": "q-broken"})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_help_for_every_subcommand():
    for sub in ([], ["caption"], ["ask"], ["eval"]):
        out = mmkit(*sub, "--help")
        assert out.returncode == 0 and "usage: mmkit" in out.stdout
    assert "--retry-errors" in mmkit("eval", "--help").stdout


def test_caption_and_ask(tiny_ckpt, tmp_path):
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"{i}.png")
        make_image(i).save(paths[-1])
    out = mmkit("caption", *map(str, paths), "--model", str(tiny_ckpt), "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip("\n").split("\n")
    assert len(lines) == 2 and lines[0].startswith(str(paths[0]) + "\t")
    out = mmkit("ask", str(paths[0]), "What is it?", "--model", str(tiny_ckpt), "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    from mmkit import SamplingParams

    llm = get_llm(tiny_ckpt)  # the session's float32 engine of this checkpoint
    ref = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(paths[0])}},
                                                  {"type": "text", "text": "What is it?"}]}],
                   SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text.strip()
    assert out.stdout.strip() == ref


def test_missing_image_is_a_clear_error(tiny_ckpt):
    out = mmkit("ask", "/no/such.png", "What?", "--model", str(tiny_ckpt))
    assert out.returncode == 2 and "such.png" in out.stderr and "Traceback" not in out.stderr


def read_results(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_records_errors_and_summarises(tiny_ckpt, dataset, tmp_path):
    results = tmp_path / "res.jsonl"
    out = mmkit("eval", str(dataset), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "3",
                "--no-progress")
    assert out.returncode == 0, out.stderr
    records = read_results(results)
    assert sorted(r["index"] for r in records) == list(range(62))
    errors = {r["index"]: r["error"] for r in records if r["error"]}
    assert set(errors) == {60, 61} and "missing.png" in errors[60] and "broken.png" in errors[61]
    summary = json.loads((tmp_path / "res.summary.json").read_text())
    assert summary["num_items"] == 62 and summary["num_errors"] == 2 and set(summary["per_type"]) == {"even", "odd"}
    assert "normalised accuracy" in out.stdout
    # The console names both failed items (index, id or image, the error's first line) and the file.
    table = out.stdout[out.stdout.index("failed items: 2"):]
    row60 = next(line for line in table.splitlines() if line.split()[:1] == ["60"])
    row61 = next(line for line in table.splitlines() if line.split()[:1] == ["61"])
    assert "img/missing.png" in row60 and errors[60].splitlines()[0][:60] in row60
    assert "q-broken" in row61 and errors[61].splitlines()[0][:60] in row61
    assert f"results: {results}" in out.stdout
    # Rerun: nothing left to do; --retry-errors reruns the two errors, each item stays once.
    again = mmkit("eval", str(dataset), "--output", str(results), "--model", str(tiny_ckpt), "--retry-errors",
                  "--no-progress")
    assert again.returncode == 0
    assert sorted(r["index"] for r in read_results(results)) == list(range(62))


def test_eval_csv(tiny_ckpt, dataset, tmp_path):
    csv_path = dataset.parent / "data.csv"
    csv_path.write_text("image,question,answer\nimg/0.png,What?,z\nimg/1.png,Which?,Z.\n")
    results = tmp_path / "csv.jsonl"
    out = mmkit("eval", str(csv_path), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "2",
                "--no-progress")
    assert out.returncode == 0, out.stderr
    assert [r["reference"] for r in read_results(results)] == [["z"], ["Z."]]


def test_eval_resumes_after_sigkill(tiny_ckpt, dataset, tmp_path):
    big = tmp_path / "big.jsonl"
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:60]
    big_rows = [dict(rows[i % 60], question=f"Q{i}") for i in range(NUM_BIG)]
    for r in big_rows:
        r["image"] = str(dataset.parent / r["image"])
    big.write_text("".join(json.dumps(r) + "\n" for r in big_rows))
    results = tmp_path / "big_res.jsonl"
    proc = spawn("eval", str(big), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "24",
                 "--no-progress", "--max-in-flight", "4", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        if results.exists() and len(results.read_bytes().splitlines()) >= 20:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = results.read_text().splitlines()
    assert 0 < len(partial) < NUM_BIG, "kill the run part way"
    out = mmkit("eval", str(big), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "24",
                "--no-progress")
    assert out.returncode == 0, out.stderr
    indices = [r["index"] for r in read_results(results)]
    assert sorted(indices) == list(range(NUM_BIG))  # every item exactly once


def test_eval_sigint_stops_cleanly_and_the_rerun_completes_each_item_once(tiny_ckpt, dataset, tmp_path):
    big = tmp_path / "big.jsonl"
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:60]
    big.write_text("".join(json.dumps(dict(rows[i % 60], question=f"Q{i}", image=str(dataset.parent / rows[i % 60]["image"])))
                           + "\n" for i in range(NUM_BIG)))
    results = tmp_path / "int_res.jsonl"
    args = ["eval", str(big), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "24",
            "--no-progress", "--max-in-flight", "4"]
    proc = spawn(*args)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if results.exists() and len(results.read_bytes().splitlines()) >= 20:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    done = len(read_results(results))
    assert 0 < done < NUM_BIG, "interrupt the run part way"
    assert stderr.strip().splitlines()[-1] == (f"mmkit eval: interrupted: {done} of {NUM_BIG} done (in {results}); "
                                              "run the same command again to resume")
    out = mmkit(*args)
    assert out.returncode == 0, out.stderr
    assert sorted(r["index"] for r in read_results(results)) == list(range(NUM_BIG))  # every item exactly once


def test_caption_sigint_prints_one_line_and_exits_130(tiny_ckpt, tmp_path):
    make_image(0).save(tmp_path / "0.png")
    # Enough work that the signal lands mid-run on a fast host too: 64 images were all captioned
    # within 0.7 s on a Zen 5 guest, so a Ctrl-C sent 1 s after loading met a finished process.
    images = [str(tmp_path / "0.png")] * 512
    proc = spawn("caption", *images, "--model", str(tiny_ckpt), "--max-tokens", "400")
    line = proc.stderr.readline()
    while line and "model loaded" not in line:  # loading first, then the time it took
        line = proc.stderr.readline()
    assert "model loaded in" in line
    # Interrupt once the first caption is out (not after a fixed delay, which lands before the
    # run on a slow host or after it on a fast one): captions print in input order, so the
    # other 511 images' 400 tokens are still ahead.
    # stderr (the progress bar) is drained meanwhile, so a full pipe never blocks the child.
    err_lines: list[str] = []
    drain = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    drain.start()
    watchdog = threading.Timer(240, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    try:
        first = proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        stdout = proc.stdout.read()
        proc.wait()
    finally:
        watchdog.cancel()
    drain.join(60)
    stderr = "".join(err_lines)
    assert first.strip(), stderr
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    # One caption per image, each line starting with its path (a caption may hold a newline).
    printed = (first + stdout).count(f"{images[0]}\t")
    assert printed < len(images)
    assert stderr.strip().splitlines()[-1] == f"mmkit caption: interrupted: {printed} of 512 images captioned (printed above)"


def test_loading_line_names_the_model_then_the_time(tiny_ckpt, tmp_path):
    make_image(0).save(tmp_path / "0.png")
    out = mmkit("ask", str(tmp_path / "0.png"), "What?", "--model", str(tiny_ckpt), "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == f"mmkit ask: loading {tiny_ckpt} ..."
    assert lines[1].startswith("mmkit ask: model loaded in ") and lines[1].endswith(" s")


@pytest.mark.parametrize("flag, suggestion", [("--max-tokns", "--max-tokens"), ("--temprature", "--temperature"),
                                              ("--max-token", "--max-tokens")])
def test_misspelt_or_abbreviated_flag_is_an_error_with_the_closest_flag(flag, suggestion):
    out = mmkit("ask", "img.png", "Q?", flag, "5")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("usage: mmkit ask ")  # the subcommand's usage, not the top-level one
    assert f"unrecognized arguments: {flag} (did you mean {suggestion}?)" in out.stderr


def test_every_parser_refuses_abbreviations():
    from mmkit.entrypoints.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices
    assert not parser.allow_abbrev and all(not p.allow_abbrev for p in subparsers.values())
    for sub, flag, suggestion in (("serve", "--prot", "--port"), ("eval", "--outptu", "--output"),
                                  ("caption", "--no-progres", "--no-progress")):
        out = mmkit(sub, "x", flag, "1")
        assert out.returncode == 2 and f"usage: mmkit {sub}" in out.stderr, out.stderr
        assert f"(did you mean {suggestion}?)" in out.stderr, out.stderr


def test_version_and_a_misspelt_top_level_flag():
    from mmkit import __version__

    out = mmkit("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mmkit {__version__}"
    out = mmkit("--verison")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("usage: mmkit [-h] [--version] COMMAND")
    assert "unrecognized arguments: --verison (did you mean --version?)" in out.stderr  # not "COMMAND is required"


def test_caption_reports_unreadable_images_and_captions_the_rest(tiny_ckpt, tmp_path):
    good = [tmp_path / "a.png", tmp_path / "b.png"]
    for i, path in enumerate(good):
        make_image(i).save(path)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    missing = tmp_path / "missing.png"
    out = mmkit("caption", str(good[0]), str(bad), str(good[1]), str(missing), "--model", str(tiny_ckpt),
                "--max-tokens", "3")
    assert out.returncode == 1, out.stderr  # some failed: not 0
    assert "Traceback" not in out.stderr
    # Every readable image is captioned, in input order.
    assert [line.split("\t")[0] for line in out.stdout.strip("\n").split("\n")] == [str(p) for p in good]
    # Each unreadable one is named on stderr with its reason, then a count.
    errors = [line for line in out.stderr.splitlines() if line.startswith("mmkit caption: error: ")]
    assert len(errors) == 2 and str(bad) in errors[0] and str(missing) in errors[1], out.stderr
    assert "does not exist" in errors[1] or "No such file" in errors[1], errors[1]
    assert f"2 of 4 images could not be read: {bad}, {missing}" in out.stderr


def test_sampling_values_are_checked_before_the_model_loads(tiny_ckpt, dataset, tmp_path):
    make_image(0).save(tmp_path / "0.png")
    image = str(tmp_path / "0.png")
    for args, name in ((["ask", image, "Q?", "--temperature", "-1"], "temperature"),
                       (["caption", image, "--max-tokens", "0"], "max_tokens"),
                       (["eval", str(dataset), "--output", str(tmp_path / "r.jsonl"), "--top-p", "0"], "top_p")):
        out = mmkit(*args, "--model", str(tiny_ckpt))
        assert out.returncode == 2, out.stderr
        assert f"error: {name}: got " in out.stderr, out.stderr
        assert "loading" not in out.stderr  # refused before the model load began
        assert not (tmp_path / "r.jsonl").exists()


def test_bare_mmkit_prints_usage_and_the_commands():
    out = mmkit()
    # Status 2 on stderr, argparse's convention for an incomplete command line; --help is 0 on stdout.
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("usage: mmkit ")
    for command, help_text in (("caption", "print one caption per image"), ("ask", "answer a question"),
                               ("eval", "evaluate a JSONL/CSV dataset"), ("serve", "serve an OpenAI-compatible")):
        assert any(line.split()[:1] == [command] and help_text in line for line in out.stderr.splitlines()), out.stderr


def test_eval_says_it_resumes_and_logs_progress_as_plain_lines(tiny_ckpt, dataset, tmp_path):
    small = tmp_path / "small.jsonl"
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:4]
    small.write_text("".join(json.dumps(dict(r, image=str(dataset.parent / r["image"]))) + "\n" for r in rows))
    results = tmp_path / "small_res.jsonl"
    args = ["eval", str(small), "--output", str(results), "--model", str(tiny_ckpt), "--max-tokens", "2"]
    out = mmkit(*args)
    assert out.returncode == 0, out.stderr
    assert "resuming" not in out.stderr
    # stderr is a pipe here, as in a log: no bar redraws, a plain line instead.
    assert "%|" not in out.stderr, out.stderr  # tqdm draws "Evaluating:  50%|█████     | 2/4"
    assert "Evaluating: 4/4 items (100%)" in out.stderr, out.stderr
    results.write_text("".join(results.read_text().splitlines(keepends=True)[:3]))
    out = mmkit(*args)
    assert out.returncode == 0, out.stderr
    assert f"mmkit eval: resuming: 3 of 4 already done (in {results})" in out.stderr.splitlines()
    assert "Evaluating: 1/1 item (100%)" in out.stderr, out.stderr
