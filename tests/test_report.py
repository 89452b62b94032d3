import json


def test_write_report_makes_json_md_and_plots(tmp_path):
    from eyas.report import write_report

    rep = {
        "name": "t",
        "eval": {"acceptance_length": 2.1, "k": 3, "per_pos": [0.6, 0.35, 0.15], "tokens_per_step": 2.05,
                 "domains": {"math": {"acceptance_length": 2.4, "tokens_per_step": 2.3},
                             "chat": {"acceptance_length": 1.9}}},
        "eval_ngram": {"tokens_per_step": 1.7, "domains": {"math": {"tokens_per_step": 1.5}}},
        "serve_eval": [{"step": 10, "true_al": 1.5, "est_al": 1.8, "eval_seconds": 30.0, "sim_al": 1.45},
                       {"step": 20, "true_al": 1.9, "est_al": 2.2}],
        "throughput": [{"concurrency": 1, "baseline_tokens_per_s": 30.0, "spec_tokens_per_s": 55.0, "speedup": 1.83,
                        "ngram_tokens_per_s": 60.0, "ngram_speedup": 2.0}],
        "serve_command": "vllm serve X",
        "train": {"step": 20, "steps_run": 20, "tokens": 40960, "steps_s": 31.4,
                  "budget": {"minutes": 0.5, "per_step_s": 1.5, "timed_steps": 8, "max_steps": 100, "fitted_steps": 20}},
    }
    paths = write_report(tmp_path, rep)
    assert json.loads(paths["json"].read_text())["eval"]["acceptance_length"] == 2.1
    md = paths["md"].read_text()
    assert "2.100" in md and "| math | 2.400 | 2.300 | 1.500 |" in md and "| chat | 1.900 | - | - |" in md
    assert "draft 2.050, vLLM's n-gram lookup on the same prompts 1.700" in md and "vllm serve X" in md
    assert "| 10 | 1.500 | 1.450 | 1.800 |" in md and "| 20 | 1.900 | - | 2.200 |" in md
    assert "| 1 | 30.000 | 55.000 | 1.830 | 2.000 |" in md and "ngram speedup" in md  # n-gram beside the draft
    assert "trainer's estimate (training batches)" in md
    assert ("Training: 20 steps; this run 20 of them, 40,960 tokens in 31 s of steps" in md
            and "train.max_minutes 0.5 fitted 20 of the 100 steps asked at 1.5 s/step" in md)
    for k in ("al_per_position", "al_over_training", "throughput"):
        assert paths[k].exists() and paths[k].stat().st_size > 1000
