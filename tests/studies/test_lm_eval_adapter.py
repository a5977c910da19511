"""The lm-eval adapter on tiny local tasks (JSON files in a temp dir: lm-eval's datasets need a network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from h2o_kv.runtime.models import bundled_gguf_path, load_model  # noqa: E402
from h2o_kv.studies.eval import lm_eval_adapter  # noqa: E402  (registers the "h2o_kv" model)

DOCS = [
    ("The cat sat on the mat all afternoon, watching the birds in the garden outside the window. "
     "Question: Where did the cat sit? Answer:", [" on the mat", " in the tree", " under the car", " on the roof"], 0),
    ("Paris is the capital and most populous city of France, on the river Seine. "
     "Question: What is the capital of France? Answer:", [" Berlin", " Madrid", " Paris", " Rome"], 2),
    ("Water freezes at zero degrees Celsius and boils at one hundred degrees Celsius at sea level. "
     "Question: At what temperature does water boil? Answer:", [" fifty", " one hundred", " zero", " ten"], 1),
    ("The sun rises in the east every morning and sets in the west every evening. "
     "Question: Where does the sun set? Answer:", [" in the north", " in the south", " in the east", " in the west"],
     3),
]  # fmt: skip


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """A multiple-choice and a generate_until task over the same 4 local documents."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "data.json"
    data.write_text("\n".join(json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in DOCS) + "\n")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        "task: h2o_kv_tiny_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "gen.yaml").write_text(
        "task: h2o_kv_tiny_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def bundled() -> None:
    try:
        bundled_gguf_path("smollm2-135m")
    except FileNotFoundError as err:
        pytest.skip(str(err))


def _run(model, task_dir: Path, task: str, **kw) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        **kw,
    )


def _loglikelihoods(result: dict, task: str) -> list[float]:
    return [resp[0][0] for s in result["samples"][task] for resp in s["resps"]]


@pytest.mark.slow
def test_multiple_choice_full_equals_stock_hf_and_tiny_budget_changes_it(bundled, task_dir: Path) -> None:
    task = "h2o_kv_tiny_mc"
    full = _run("h2o_kv", task_dir, task, model_args="pretrained=smollm2-135m,policy=full", device="cpu")
    model, tokenizer = load_model("smollm2-135m", enable_h2o=False)
    stock = _run(HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", batch_size=1), task_dir, task)
    tiny = _run("h2o_kv", task_dir, task, model_args="pretrained=smollm2-135m,policy=h2o,budget=4,prefill_chunk=4")
    accs = [r["results"][task]["acc,none"] for r in (full, stock, tiny)]
    assert all(0.0 <= a <= 1.0 for a in accs)
    assert accs[0] == accs[1]
    assert _loglikelihoods(full, task) == pytest.approx(_loglikelihoods(stock, task), abs=1e-3)
    changed = [abs(a - b) for a, b in zip(_loglikelihoods(full, task), _loglikelihoods(tiny, task))]
    assert max(changed) > 0.5


@pytest.mark.slow
def test_generate_until_and_fractional_budget(bundled, task_dir: Path) -> None:
    task = "h2o_kv_tiny_gen"
    full = _run("h2o_kv", task_dir, task, model_args={"pretrained": "smollm2-135m", "policy": "full"})
    model, tokenizer = load_model("smollm2-135m", enable_h2o=False)
    stock = _run(HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", batch_size=1), task_dir, task)
    h2o = _run("h2o_kv", task_dir, task, model_args="pretrained=smollm2-135m,policy=h2o,budget=0.5,prefill_chunk=8")
    outputs = [[s["filtered_resps"] for s in r["samples"][task]] for r in (full, stock, h2o)]
    assert outputs[0] == outputs[1]
    assert 0.0 <= h2o["results"][task]["exact_match,none"] <= 1.0
    assert all(isinstance(o[0], str) for o in outputs[2])


def test_adapter_rejects_bad_policy_and_budget(bundled) -> None:
    model, tokenizer = load_model("smollm2-135m")
    with pytest.raises(ValueError):
        lm_eval_adapter.H2OKVLM(pretrained=model, tokenizer=tokenizer, policy="nope", budget=0.2)
    with pytest.raises(ValueError):
        lm_eval_adapter.H2OKVLM(pretrained=model, tokenizer=tokenizer, policy="h2o", budget=2.5)
    lm = lm_eval_adapter.H2OKVLM(pretrained=model, tokenizer=tokenizer, policy="h2o", budget=0.25)
    cache = lm.new_cache(100)
    assert cache.policy.capacity(torch.tensor([100])).tolist() == [25] and cache.prefill_chunk == 1
    assert lm_eval_adapter.H2OKVLM(pretrained=model, tokenizer=tokenizer, budget="64").new_cache(1000).policy.capacity(
        torch.tensor([1000])
    ).tolist() == [64]  # model_args text: "64" is tokens
