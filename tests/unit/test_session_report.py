"""loadtests.lib.report's per-session and per-turn sections: the generator's waits (planned and really waited), TTFT by
turn index and cache path, and m3gate's measured waits matched by the hashed session id."""

from __future__ import annotations

from loadtests.lib.client import Result
from loadtests.lib.report import session_markdown, session_report
from loadtests.lib.workload import build_plan
from policies.sessions import redacted


def _plan():
    return build_plan({"name": "a", "seed": 3, "sessions": [{
        "name": "agent", "count": 2, "arrival": {"process": "constant", "rate": 10},
        "system_prompts": {"count": 1, "tokens": 50}, "tools": {"count": 2, "tokens_each": 60}, "turns": 3,
        "first_user_tokens": 20, "user_tokens": 10, "tool_result_share": 1.0, "tool_result_tokens": 10,
        "output_tokens": 10, "think_time_s": 1.0, "tool_time_s": 0.2}]})


def test_waits_task_time_ttft_by_turn_and_m3gates_view_matched_by_hashed_id() -> None:
    plan = _plan()
    results, seen = [], []
    for sid, turns in plan.sessions().items():
        t = 0.0
        recent = []
        for item in turns:
            r = Result(item, t_send=t + item.wait_s + (0.003 if item.turn else 0.0))
            r.ttft, r.e2el, r.prompt_tokens = 0.01 * (item.turn + 1), 0.1, 100
            r.cached_tokens = 0 if item.turn == 0 else 80
            results.append(r)
            if item.turn:
                recent.append({"index": item.turn + 1, "wait": "tool" if turns[item.turn - 1].tool_call else "think",
                               "wait_s": item.wait_s + 0.005})
            t = r.t_send + r.e2el
        seen.append({"id": redacted(sid), "recent_turns": recent})
    report = session_report(plan, results, seen)
    assert report["sessions"] == report["complete"] == 2
    assert report["turns"] == {"p50": 3.0, "max": 3}
    waits = report["waits_ms"]
    assert waits["tool"]["n"] + waits["think"]["n"] == 4
    assert abs(waits["tool"]["waited"]["p50"] - waits["tool"]["planned"]["p50"] - 3.0) < 0.01
    assert report["m3gate"]["sessions_found"] == 2 and report["m3gate"]["compared_turns"] == 4
    assert abs(report["m3gate"]["diff_ms"]["p50"] - 2.0) < 0.01  # m3gate 5 ms more than planned, generator 3 ms
    assert set(report["ttft_ms_by_turn"]) == {"1/cold", "2/warm", "3-4/warm"}
    text = "\n".join(session_markdown(report))
    assert "## Sessions" in text and "## Turns: TTFT by turn index" in text and "2 of 2 sessions found" in text
    assert "m3gate" not in session_report(plan, results)  # no gateway view: generator only
