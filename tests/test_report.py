import json


def test_write_report_makes_json_md_and_plots(tmp_path):
    from eyas.report import write_report

    rep = {
        "name": "t",
        "eval": {"acceptance_length": 2.1, "k": 3, "per_pos": [0.6, 0.35, 0.15],
                 "domains": {"math": {"acceptance_length": 2.4}, "chat": {"acceptance_length": 1.9}}},
        "serve_eval": [{"step": 10, "true_al": 1.5, "est_al": 1.8, "eval_seconds": 30.0}, {"step": 20, "true_al": 1.9, "est_al": 2.2}],
        "throughput": [{"concurrency": 1, "baseline_tokens_per_s": 30.0, "spec_tokens_per_s": 55.0, "speedup": 1.83}],
        "serve_command": "vllm serve X",
    }
    paths = write_report(tmp_path, rep)
    assert json.loads(paths["json"].read_text())["eval"]["acceptance_length"] == 2.1
    md = paths["md"].read_text()
    assert "2.100" in md and "| math | 2.400 |" in md and "vllm serve X" in md
    for k in ("al_per_position", "al_over_training", "throughput"):
        assert paths[k].exists() and paths[k].stat().st_size > 1000
