"""`kame-phone eval`: the paper's quality-vs-latency measurement, dialed over the phone path.

questions (MT-Bench JSONL, the paper's suite) -> voices (TTS) -> line_caller (a call per question:
ask, listen until the bot falls quiet; probes with a pause and a barge-in) -> transcribe (ASR) ->
judge (MT-Bench single-answer grading) -> report (report.json, report.md) and plots; compare diffs runs.
"""
