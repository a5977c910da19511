"""The conversation study's pieces that need no server: conversations, per-turn summaries, refused flags."""

from __future__ import annotations

import pytest

from h2o_kv.studies.conversations import QUESTIONS, Conversation, Turn, conversations, main, summarize


def test_the_document_opens_each_conversation_and_every_turn_asks_one_question():
    convs = conversations(["doc one", "doc two"], turns=3)
    assert [c.questions[0] for c in convs] == [f"doc one\n\n{QUESTIONS[0]}", f"doc two\n\n{QUESTIONS[1]}"]
    assert [len(c.questions) for c in convs] == [3, 3] and convs[1].questions[1:] == list(QUESTIONS[2:4])
    with pytest.raises(ValueError, match="--turns"):
        conversations(["doc"], turns=len(QUESTIONS) + 1)


def test_a_turns_row_counts_errors_and_missing_turns_and_averages_reuse():
    ok = [Turn(ttft=t, latency=2 * t, prompt_tokens=100, cached_tokens=c, completion_tokens=4)
          for t, c in ((1.0, 90), (3.0, 70))]  # fmt: skip
    convs = [Conversation([], ["q"], [Turn(ttft=9.0, prompt_tokens=50), ok[0]]),
             Conversation([], ["q"], [Turn(ttft=8.0, prompt_tokens=50), ok[1]]),
             Conversation([], ["q"], [Turn(error="boom")])]  # fmt: skip
    first, second = summarize("reuse", convs, turns=2)
    assert (first["errors"], first["ttft_s_p50"], first["prompt_tokens_mean"]) == (1, 8.5, 50.0)
    assert (second["errors"], second["ttft_s_p50"], second["cached_tokens_mean"]) == (1, 2.0, 80.0)
    assert second["latency_s_p50"] == 4.0 and second["completion_tokens"] == 8


@pytest.mark.parametrize("flags", [["--modes", "both"], ["--modes", "fresh", "--check", "2"]])
def test_bad_flags_are_one_line_and_exit_2(flags, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conversations: error:") and "\n" not in err


def test_a_mode_run_alone_keeps_the_other_modes_results_of_the_same_study(tmp_path):
    """Each mode is saved as it ends; a later `--modes fresh` keeps the reuse run already there (the same study),
    replaces an earlier fresh one, and refuses a file of another study rather than overwrite it."""
    import argparse
    import json

    from h2o_kv.studies.conversations import add_arguments, earlier

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--conversations", "4"])
    path = tmp_path / "conversations.json"
    assert earlier(path, args, ["fresh"]) == ([], {})
    settings = dict(vars(args))
    runs = {mode: {"wall_s": 1.0, "meta": {"settings": settings}} for mode in ("reuse", "fresh")}
    rows = [{"mode": mode, "turn": 1} for mode in ("reuse", "fresh")]
    path.write_text(json.dumps({"rows": rows, "runs": runs}))
    kept_rows, kept_runs = earlier(path, args, ["fresh"])
    assert kept_rows == [rows[0]] and list(kept_runs) == ["reuse"]
    with pytest.raises(ValueError, match="conversations differ"):
        earlier(path, parser.parse_args(["--conversations", "32"]), ["fresh"])
