"""A Ray that fails to start: a bounded retry, then one clear line (no Ray traceback)."""

import json

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402

from mmkit.entrypoints.cli.main import main  # noqa: E402
from mmkit.ray import cluster  # noqa: E402
from mmkit.ray.cluster import init_ray  # noqa: E402

# What Ray raises when its GCS misses the startup deadline on a busy machine (abridged).
RAY_ERROR = ("Failed to start the GCS server.\n"
             "Traceback (most recent call last):\n  File \"ray/_private/node.py\", line 1155\n"
             "    raise RuntimeError(...)\nRuntimeError: timed out after 30 s")


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init failing its first `fake_ray.failures` calls; no waiting between tries."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) <= fake_ray.failures:
            raise RuntimeError(RAY_ERROR)

    fake_ray = type("FakeRay", (), {"failures": 0, "calls": calls})
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "RETRY_DELAYS_S", (0.0, 0.0), raising=False)
    return fake_ray


def test_a_flaky_local_start_is_tried_again(fake_ray):
    fake_ray.failures = 2
    init_ray(num_cpus=2)
    assert len(fake_ray.calls) == 3 and all(c["address"] == "local" for c in fake_ray.calls)


def test_a_local_start_that_keeps_failing_is_one_line_with_the_logs_and_the_hint(fake_ray):
    fake_ray.failures = 99
    with pytest.raises(cluster.RayStartError) as exc_info:
        init_ray(num_cpus=2)
    assert len(fake_ray.calls) == 3  # bounded
    message = str(exc_info.value)
    assert "\n" not in message
    assert message.startswith("could not start Ray on this machine (3 tries): RuntimeError: Failed to start the GCS")
    assert f"Ray's logs: {cluster.ray_log_dir()}" in message and "session_latest/logs" in message
    assert "--ray-address" in message and "run the command again" in message


def test_a_cluster_that_cannot_be_reached_is_not_retried(fake_ray):
    fake_ray.failures = 99
    with pytest.raises(cluster.RayStartError, match=r"^could not connect to the Ray cluster at 10\.0\.0\.1:6379: RuntimeError"):
        init_ray("10.0.0.1:6379")
    assert len(fake_ray.calls) == 1


def test_eval_ray_prints_one_line_when_ray_does_not_start(fake_ray, tmp_path, capsys):
    fake_ray.failures = 99
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"image": "a.png", "question": "Q?"}) + "\n")
    status = main(["eval", str(data), "--output", str(tmp_path / "r.jsonl"), "--ray"])
    err = capsys.readouterr().err
    assert status == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("mmkit eval:")]
    assert len(lines) == 1 and lines[0].startswith("mmkit eval: error: could not start Ray on this machine"), err
    assert "--ray-address" in lines[0] and "Ray's logs: " in lines[0]
