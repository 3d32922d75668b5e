"""`patchkit bench`: open-loop Poisson load and a closed loop of clients against a real endpoint (an
inprocess deployment), its report, JSON and plot, and its errors for arguments it cannot run."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from components import Generator, Retriever, Slow

import patchkit
from patchkit import bench
from patchkit.bench import BenchResult, Schedule, run_bench, run_closed
from patchkit.bench.report import RequestRecord

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [{"query": "How do I catch an exception?"}, {"query": "What is a generator?"}]
RATE, SECONDS = 40.0, 2.0

retriever, llm = Retriever(topk=2), Generator()


def rag(query: str) -> str:
    with patchkit.capture():
        docs = retriever.retrieve(query)
        return llm.generate(query, docs)


def _slo_met_on_server(url: str) -> float:
    """The endpoint's own count of requests that met the SLO they carried."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(r"^patchkit_requests_slo_met_total (\S+)$", text, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    rag("How do I catch an exception?")
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", replicas={"llm": 2}) as served:
        yield served


@pytest.fixture(scope="module")
def steady(endpoint: patchkit.Endpoint) -> tuple[BenchResult, float]:
    """One 2 s run at 40 req/s with a generous SLO, and how much the endpoint's SLO-met count rose."""
    before = _slo_met_on_server(endpoint.url)
    result = run_bench(endpoint.url, rate=RATE, seconds=SECONDS, inputs=QUESTIONS, slo_ms=10_000)
    return result, _slo_met_on_server(endpoint.url) - before


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_schedule_parses_steps_and_rejects_what_it_cannot_run() -> None:
    schedule = Schedule.parse("0:50,10:100,20:50")
    assert schedule.steps == ((0.0, 50.0), (10.0, 100.0), (20.0, 50.0))
    assert [schedule.rate_at(t) for t in (0, 9.9, 10, 25)] == [50, 50, 100, 50]
    with pytest.raises(patchkit.PatchkitError, match="must start at 0 s; its first step starts at 5 s"):
        Schedule.parse("5:50")
    with pytest.raises(patchkit.PatchkitError, match="increasing time order; 10 s comes after 20 s"):
        Schedule.parse("0:50,20:10,10:5")
    with pytest.raises(patchkit.PatchkitError, match="rate must be > 0 requests/s; got 0 \\(at 10 s\\)"):
        Schedule.parse("0:50,10:0")
    with pytest.raises(patchkit.PatchkitError, match="seconds:rate steps such as 0:50,10:100; got 'fast'"):
        Schedule.parse("0:50,fast")
    with pytest.raises(patchkit.PatchkitError, match="step at 30 s starts after the run ends \\(seconds=30\\)"):
        Schedule.parse("0:50,30:10").check_fits(30)


def test_arrivals_repeat_with_the_seed_and_follow_each_steps_rate() -> None:
    schedule = Schedule.parse("0:10,100:100")
    times = schedule.arrivals(200, random.Random(7))
    assert times == schedule.arrivals(200, random.Random(7))
    assert times != schedule.arrivals(200, random.Random(8))
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200
    slow, fast = sum(t < 100 for t in times), sum(t >= 100 for t in times)
    assert 900 <= slow <= 1100 and 9_500 <= fast <= 10_500  # Poisson counts: mean 1,000 and 10,000


def test_throughput_counts_the_answers_within_the_run_per_second_of_it() -> None:
    """Records on a clock of the test's own: sent at `sent_s`, answered `latency_ms` later."""
    records = [
        RequestRecord(0.1, 0.0, 100.0, 200),  # answered at 0.2 s
        RequestRecord(0.5, 2.0, 400.0, 200),  # sent 2 ms after its arrival, answered at 0.9 s
        RequestRecord(1.0, 0.0, 10.0, 503, "Overloaded"),  # an error: not throughput
        RequestRecord(1.2, 0.0, 700.0, 200),  # answered at 1.9 s
        RequestRecord(1.8, 30.0, 500.0, 200),  # answered at 2.3 s, after the run's 2 s: not in it
    ]
    summary = BenchResult("http://127.0.0.1:1", 2.0, Schedule.constant(2.5), None, 0, 2.3, records).summary()
    assert (summary["requests"], summary["ok"], summary["errors"]) == (5, 4, 1)
    assert summary["offered_rate"] == 5 / 2.0 and summary["throughput"] == 3 / 2.0
    assert summary["send_lag_ms"]["max"] == 30.0
    assert summary["latency_ms"]["max"] == 700.0  # of the answered requests only


def test_arguments_it_cannot_run_fail_before_any_load() -> None:
    url = _closed_port_url()
    with pytest.raises(patchkit.PatchkitError, match="rate must be > 0 requests/s; got 0"):
        run_bench(url, rate=0, seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match="rate must be > 0 requests/s; got -5"):
        run_bench(url, rate=-5, seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match="either rate= or schedule="):
        run_bench(url, rate=5, schedule="0:5", seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match="JSON objects such as"):
        run_bench(url, rate=5, seconds=1, inputs=["How do I catch an exception?"])  # type: ignore[list-item]
    with pytest.raises(patchkit.PatchkitError, match="must start with http:// or https://"):
        run_bench("127.0.0.1:8000", rate=5, seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match=f"cannot reach the endpoint at {url} .*is it running"):
        run_bench(url, rate=5, seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match="concurrency must be >= 1; got 0"):
        run_closed(url, concurrency=0, seconds=1, inputs=QUESTIONS[0])
    with pytest.raises(patchkit.PatchkitError, match=f"cannot reach the endpoint at {url} .*is it running"):
        run_closed(url, concurrency=2, seconds=1, inputs=QUESTIONS[0])


def test_from_async_code_it_says_to_run_it_in_a_thread() -> None:
    async def notebook_cell() -> BenchResult:
        return run_bench(_closed_port_url(), rate=5, seconds=1, inputs=QUESTIONS[0])

    with pytest.raises(patchkit.PatchkitError, match="asyncio.to_thread"):
        asyncio.run(notebook_cell())


def test_invalid_inputs_on_the_command_line_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _closed_port_url()
    assert bench.main([url, "--rate", "5", "--seconds", "1", "--inputs", '{"query": "unclosed']) == 2
    assert "patchkit bench: --inputs is not valid JSON" in capsys.readouterr().err
    assert bench.main([url, "--rate", "5", "--seconds", "1", "--inputs", '["a list"]']) == 2
    assert '--inputs must be a JSON object such as {"query": "..."}' in capsys.readouterr().err
    lines = tmp_path / "inputs.jsonl"
    lines.write_text('{"query": "fine"}\n\n{"query": broken}\n')
    assert bench.main([url, "--rate", "5", "--seconds", "1", "--inputs-file", str(lines)]) == 2
    assert f"{lines}:3 is not valid JSON" in capsys.readouterr().err
    assert bench.main([url, "--rate", "0", "--seconds", "1", "--inputs", "{}"]) == 2
    assert "rate must be > 0" in capsys.readouterr().err
    assert bench.main([url, "--concurrency", "0", "--seconds", "1", "--inputs", "{}"]) == 2
    assert "concurrency must be >= 1; got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an open and a closed loop at once
        bench.main([url, "--rate", "5", "--concurrency", "2", "--seconds", "1", "--inputs", "{}"])
    assert "not allowed with argument --rate" in capsys.readouterr().err


@pytest.mark.skipif(find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_without_matplotlib_plot_names_the_extra_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    url = _closed_port_url()  # nothing listens: the missing library is reported before the endpoint is tried
    assert bench.main([url, "--rate", "5", "--seconds", "1", "--inputs", "{}", "--plot", "out.png"]) == 2
    told = "--plot needs matplotlib, which is not installed: pip install -e '.[bench]' in patchkit's checkout"
    assert told in capsys.readouterr().err


@pytest.mark.slow
def test_an_endpoint_rejecting_the_inputs_stops_the_run_at_the_start(endpoint: patchkit.Endpoint) -> None:
    with pytest.raises(patchkit.PatchkitError, match="the endpoint rejects the inputs \\(400\\): .*'question'"):
        run_bench(endpoint.url, rate=5, seconds=1, inputs={"question": "What is a generator?"})


@pytest.mark.slow
def test_counts_add_up_and_throughput_follows_the_offered_rate(steady: tuple[BenchResult, float]) -> None:
    result, _ = steady
    summary = result.summary()
    arrivals = Schedule.constant(RATE).arrivals(SECONDS, random.Random(0))
    assert summary["requests"] == len(result.requests) == len(arrivals)  # one record per arrival, none lost
    assert summary["ok"] + summary["errors"] == summary["requests"]
    assert summary["errors"] == 0 and summary["errors_by_status"] == {}
    # each request was sent for its own arrival of the seeded schedule (its send time less its lag): the offered rate
    assert [r.sent_s - r.lag_ms / 1000 for r in result.requests] == pytest.approx(arrivals)
    assert summary["offered_rate"] == len(arrivals) / SECONDS
    assert [r.sent_s for r in result.requests] == sorted(r.sent_s for r in result.requests)
    assert all(r.server_ms is not None and 0 < r.server_ms <= r.latency_ms for r in result.requests)
    lat = summary["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert summary["slo_attainment"] == 1.0
    assert sum(result.series()["sent"]) == summary["requests"]


@pytest.mark.slow
def test_requests_carry_the_slo_and_the_endpoint_counts_them(steady: tuple[BenchResult, float]) -> None:
    result, slo_met_on_server = steady
    ok = result.summary()["ok"]
    assert ok <= slo_met_on_server <= ok + 1  # + the check of the inputs before the run


@pytest.mark.slow
def test_an_impossible_slo_is_missed() -> None:
    rag("How do I catch an exception?")
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as served:  # its own: no SLO state left behind
        result = run_bench(served.url, rate=20, seconds=0.5, inputs=QUESTIONS, slo_ms=0.001)
    summary = result.summary()
    assert summary["requests"] > 0 and summary["ok"] + summary["errors"] == summary["requests"]
    assert summary["slo_attainment"] < 1.0
    assert "SLO attainment (<= 0.001 ms)" in result.table()


@pytest.mark.slow
def test_errors_are_counted_by_status_and_type() -> None:
    slow = Slow(seconds=0.02)

    def echo(text: str) -> str:
        with patchkit.capture():
            return slow.echo(text)

    echo("a")
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", max_inflight_requests=2) as served:
        full = run_bench(served.url, rate=100, seconds=0.5, inputs={"text": "a"}).summary()
        guarded = run_bench(served.url, rate=100, seconds=0.5, inputs={"text": "a"}, concurrency_limit=1).summary()
    assert full["errors"] > 0 and full["ok"] + full["errors"] == full["requests"]
    assert full["errors_by_status"] == {"503": full["errors"]} and full["errors_by_type"] == {"Overloaded": full["errors"]}
    # Arrivals while one request is outstanding are not sent (the loop stays open: nothing waits).
    assert guarded["errors"] > 0 and guarded["ok"] + guarded["errors"] == guarded["requests"] == full["requests"]
    assert guarded["errors_by_status"] == {"no reply": guarded["errors"]}
    assert guarded["errors_by_type"] == {"ConcurrencyLimit": guarded["errors"]}


@pytest.mark.slow
def test_schedule_steps_change_the_requests_sent_in_each(endpoint: patchkit.Endpoint) -> None:
    result = run_bench(endpoint.url, schedule="0:20,1:80", seconds=2, inputs=QUESTIONS)
    low, high = result.steps()
    assert (low["rate"], high["rate"]) == (20, 80)
    assert high["requests"] > 2 * low["requests"] > 0
    series = result.series()
    assert series["offered_rate"] == [20, 80]
    assert series["sent"] == [low["requests"], high["requests"]]
    assert result.summary()["slo_attainment"] is None  # no SLO given: nothing to attain
    assert "0-1 s" in result.table() and "1-2 s" in result.table()


@pytest.mark.slow
def test_stats_polling_records_replicas_per_component(steady: tuple[BenchResult, float]) -> None:
    result, _ = steady
    assert len(result.replicas) >= 2  # once a second
    assert all(sample.replicas == {"retriever": 1, "llm": 2} for sample in result.replicas)
    assert [s.t_s for s in result.replicas] == sorted(s.t_s for s in result.replicas)
    assert re.search(r"llm\s+2\s+2\s+2\s+2", result.table())


@pytest.mark.slow
def test_json_round_trips(steady: tuple[BenchResult, float], tmp_path: Path) -> None:
    result, _ = steady
    path = tmp_path / "bench.json"
    result.write_json(path)
    data = json.loads(path.read_text())
    assert data["summary"]["requests"] == len(data["requests"]) == len(result.requests)
    assert set(data["series"]) >= {"t_s", "offered_rate", "sent", "completed_ok", "p50_ms", "p99_ms", "slo_attainment"}
    assert data["replicas"][0]["replicas"] == {"retriever": 1, "llm": 2}
    assert BenchResult.from_dict(data).to_dict() == data


@pytest.mark.slow
def test_plot_writes_a_png(steady: tuple[BenchResult, float], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    steady[0].plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_cli_subcommand_benchmarks_an_endpoint(endpoint: patchkit.Endpoint, tmp_path: Path) -> None:
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "patchkit.cli", "bench", endpoint.url, "--rate", "20", "--seconds", "1",
               "--inputs-file", str(inputs), "--slo-ms", "10000", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"throughput \(req/s\)\s+\d", done.stdout)
    assert f"wrote {out}" in done.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] > 0 and summary["errors"] == 0 and summary["slo_attainment"] == 1.0
    unreachable = subprocess.run([*command[:4], _closed_port_url(), *command[5:]], capture_output=True, text=True, cwd=ROOT,
                                 timeout=60)
    assert unreachable.returncode == 2
    assert "patchkit bench: cannot reach the endpoint at http://127.0.0.1:" in unreachable.stderr


@pytest.mark.slow
def test_a_closed_loop_keeps_its_clients_busy_and_never_more(endpoint: patchkit.Endpoint) -> None:
    result = run_closed(endpoint.url, concurrency=3, seconds=1, inputs=QUESTIONS)
    summary = result.summary()
    assert summary["requests"] > 3 and summary["errors"] == 0  # each client sent again once answered
    # A request arrives when its client is free: past the first 3, the k-th arrival comes after k - 3 replies.
    arrivals = sorted(r.sent_s - r.lag_ms / 1000 for r in result.requests)
    replies = sorted(r.sent_s + r.latency_ms / 1000 for r in result.requests)
    assert all(arrival >= reply for arrival, reply in zip(arrivals[3:], replies))
    assert all(r.server_ms is not None and 0 < r.server_ms <= r.latency_ms for r in result.requests)
    intervals = [(r.sent_s, r.sent_s + r.latency_ms / 1000) for r in result.requests]
    busiest = max(sum(start <= t < end for start, end in intervals) for t, _ in intervals)
    assert busiest <= 3  # never more outstanding than clients
    assert result.schedule is None and result.concurrency == 3 and result.steps() == []
    assert set(result.series()["offered_rate"]) == {None}
    assert "a closed loop of 3 clients for 1 s" in result.table()
    assert BenchResult.from_dict(result.to_dict()).to_dict() == result.to_dict()


@pytest.mark.slow
def test_python_m_patchkit_bench_runs_a_closed_loop(endpoint: patchkit.Endpoint, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "patchkit.bench", endpoint.url, "--concurrency", "2", "--seconds", "1",
               "--inputs", json.dumps(QUESTIONS[0]), "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "a closed loop of 2 clients" in done.stdout
    data = json.loads(out.read_text())
    assert data["concurrency"] == 2 and data["schedule"] is None
    assert data["summary"]["requests"] == len(data["requests"]) > 0 and data["summary"]["errors"] == 0


def test_a_streamed_run_reports_time_to_first_token(endpoint: patchkit.Endpoint) -> None:
    result = run_closed(endpoint.url, concurrency=2, seconds=0.5, inputs=QUESTIONS, stream=True)
    summary = result.summary()
    assert summary["ok"] == summary["requests"] > 0 and summary["ttft_ms"] is not None
    # nothing here streams deltas, so the first token is the whole answer
    assert all(r.ttft_ms is not None and 0 < r.ttft_ms <= r.latency_ms for r in result.requests)
    assert "time to first token p50 (ms)" in result.table()
    assert BenchResult.from_dict(result.to_dict()).summary()["ttft_ms"] == summary["ttft_ms"]
    plain = run_closed(endpoint.url, concurrency=1, seconds=0.2, inputs=QUESTIONS)
    assert plain.summary()["ttft_ms"] is None and "first token" not in plain.table()
