"""benchmarks/learning: the summarizer's statistics (hand-derived numbers) and how it reads a run's change."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "learning"))

from stats import binomial_se, paired_difference, summarize, t_quantile_975, verdict  # noqa: E402


def test_summary_of_four_values_by_hand():
    # mean 3; squared deviations 4+1+0+9 = 14, / 3 -> std sqrt(14/3) = 2.16025; se = std / 2 = 1.08012;
    # t_{0.975,3} = 3.182 -> half-width 3.43695
    s = summarize([1.0, 2.0, 3.0, 6.0])
    assert s.n == 4 and s.mean == 3.0
    assert s.std == pytest.approx(2.16025, abs=1e-5)
    assert (s.low, s.high) == pytest.approx((3 - 3.43695, 3 + 3.43695), abs=1e-4)
    assert not s.excludes_zero()


def test_one_value_has_no_interval_and_none_is_an_error():
    s = summarize([2.5])
    assert s.mean == 2.5 and math.isnan(s.std) and math.isnan(s.low) and not s.excludes_zero()
    with pytest.raises(ValueError, match="no values"):
        summarize([])


def test_paired_difference_uses_only_common_seeds():
    # seed 4 exists only in b; differences 2, 3, -1: mean 4/3, squared deviations (4 + 25 + 49)/9 = 78/9, / 2 ->
    # std sqrt(39/9) = 2.08167; se = 2.08167 / sqrt(3) = 1.20185; t_{0.975,2} = 4.303 -> half-width 5.17156
    d, seeds = paired_difference({1: 10.0, 2: 12.0, 3: 9.0}, {1: 8.0, 2: 9.0, 3: 10.0, 4: 5.0})
    assert seeds == [1, 2, 3]
    assert d.mean == pytest.approx(4 / 3) and d.std == pytest.approx(2.08167, abs=1e-5)
    assert d.high - d.mean == pytest.approx(5.17156, abs=1e-4)
    with pytest.raises(ValueError, match="no seed in common"):
        paired_difference({1: 1.0}, {2: 1.0})


def test_t_quantiles_and_binomial_se():
    assert t_quantile_975(2) == 4.303 and t_quantile_975(30) == 2.042 and t_quantile_975(200) == 1.96
    with pytest.raises(ValueError, match="df=0"):
        t_quantile_975(0)
    assert binomial_se(0.5, 400) == pytest.approx(0.025)  # the held-out set's worst case: 2.5 points


def test_verdict_reads_the_interval():
    # [1, 2, 3]: mean 2, std 1, half-width 4.303 / sqrt(3) = 2.484 -> [-0.48, 4.48] includes 0
    assert verdict(summarize([1.0, 2.0, 3.0]), "CPO", "GRPO").startswith("no difference")
    assert verdict(summarize([5.0, 6.0, 7.0]), "CPO", "GRPO").startswith("CPO better")
    assert verdict(summarize([-5.0, -6.0, -7.0]), "CPO", "GRPO").startswith("CPO worse")


def test_run_change_is_last_minus_first_validation(tmp_path):
    from summarize import load

    run = tmp_path / "arith12" / "cpo" / "seed2"
    run.mkdir(parents=True)
    rows = [{"step": 0, "val/acc": 0.3, "val/megatron_cpo/arith/acc": 0.25, "val/count": 400},
            {"step": 1, "reward/acc": 0.5}, {"step": 40, "val/acc": 0.45, "val/megatron_cpo/arith/acc": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    record = {"task": "arith12", "algo": "cpo", "seed": 2, "returncode": 0}
    (run / "run.json").write_text(json.dumps(record))
    result = load(run)
    assert (result.before, result.after) == pytest.approx((30.0, 45.0))
    assert result.change == pytest.approx(15.0) and result.never_seen_change == pytest.approx(25.0)
    assert result.count == 400
    (run / "run.json").write_text(json.dumps({**record, "returncode": 1}))
    assert load(run) is None, "a failed run must not enter the table"


def test_the_distillation_rows_make_their_teacher_first(capsys):
    """Table (f): a run distilling from the engine teacher is preceded by the teacher's GRPO run (skipped when its
    kept model exists), which keeps its final policy; self-distillation needs no teacher run."""
    from run_table import main

    main(["--list", "--only", "f:opd:1"])
    teacher, opd = capsys.readouterr().out.splitlines()
    assert "trainer.total_training_steps=100" in teacher and "teacher/seed0 " in teacher
    assert "teacher_model.model_path=benchmarks/learning/runs/arith12/teacher/seed0/model " in opd + " "
    main(["--list", "--only", "f:opsd:1"])
    (opsd,) = capsys.readouterr().out.splitlines()
    assert "teacher_model.kind=self" in opsd and "temperature=1.0" in opsd


def test_the_self_teacher_check_scores_each_token_where_the_model_sampled_it():
    """check_self_teacher.py's log-probs of a response after a prompt are the ones the model sampled the response
    with (generate's scores at temperature 1): the scoring is aligned with the tokens, not one position off."""
    import torch
    from check_self_teacher import token_log_probs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = ROOT / "examples" / "tiny" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    torch.manual_seed(0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=12, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=tokenizer.eos_token_id)
    response = out.sequences[0, len(prompt):].tolist()
    sampled = torch.stack([torch.log_softmax(step[0].float(), -1)[token] for step, token in zip(out.scores, response)])
    assert len(response) >= 2
    torch.testing.assert_close(token_log_probs(model, prompt, response), sampled, atol=1e-4, rtol=0)
