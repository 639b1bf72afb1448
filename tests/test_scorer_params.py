"""Scorer-owned parameters: each scorer declares its ``Params``; stages validate ``scorer_params`` against the chosen
scorer (flat keys next to ``scorer`` are routed there), dump one nested form, and refuse what the scorer lacks."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

import kvstack
from kvstack import ModelShape, Scorer, SpecError, StackSpec
from kvstack.stack import spec_doc
from kvstack.stages.scorers import get_scorer, register_scorer, scorer_names, unregister_scorer

#: a valid value strategy for every parameter of a built-in scorer (a new parameter must be added here)
VALUES = {
    "window": st.integers(1, 64),
    "kernel": st.integers(0, 7).map(lambda k: 2 * k + 1),
    "pooling": st.sampled_from(["max", "avg"]),
    "saliency": st.sampled_from(["joint", "key", "value"]),
    "seed": st.integers(-(2**31), 2**31),
}
BUILTIN = ["h2o", "key_norm", "obcache", "random", "snapkv", "tova", "value_key_ratio", "window"]


def evict(**fields) -> dict:
    return {"budget": {"tokens": 128}, "stages": [{"kind": "evict", **fields}]}


def error_of(source) -> str:
    with pytest.raises(SpecError) as info:
        StackSpec.load(source)
    return str(info.value)


def test_each_builtin_scorer_declares_its_own_parameters():
    params = {name: list(get_scorer(name).Params.model_fields) for name in BUILTIN}
    assert params == {
        "h2o": [], "key_norm": [], "obcache": ["window", "saliency"], "random": ["seed"],
        "snapkv": ["window", "kernel", "pooling"], "tova": [], "value_key_ratio": [], "window": [],
    }  # fmt: skip
    assert {p for names in params.values() for p in names} == set(VALUES)
    assert get_scorer("snapkv").Params().model_dump() == {"window": 32, "kernel": 7, "pooling": "max"}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), scorer=st.sampled_from(BUILTIN), stage=st.sampled_from(["evict", "quantized_prune"]))
def test_flat_and_nested_forms_load_alike_and_dump_nested(data, scorer, stage):
    own = list(get_scorer(scorer).Params.model_fields)
    chosen = data.draw(st.lists(st.sampled_from(own), unique=True)) if own else []
    values = {name: data.draw(VALUES[name]) for name in chosen}
    extra = {"tiers": [{"fraction": 1.0, "bits": 16}]} if stage == "quantized_prune" else {"budget": {"tokens": 128}}
    base = {"kind": stage, "scorer": scorer, **extra}
    flat = StackSpec.load({"stages": [{**base, **values}]})
    nested = StackSpec.load({"stages": [{**base, "scorer_params": values}]})
    assert flat == nested
    params = flat.stages[0].scorer_params
    assert isinstance(params, get_scorer(scorer).Params)
    assert params.model_dump() == {**get_scorer(scorer).Params().model_dump(), **values}
    dumped = flat.model_dump(mode="json")["stages"][0]
    assert set(dumped) & set(VALUES) == set()  # one canonical form: nested
    assert dumped["scorer_params"] == params.model_dump(mode="json")
    assert StackSpec.from_yaml(flat.to_yaml()) == flat
    # a parameter only other scorers have is refused, naming this scorer's parameters and those that have it
    foreign = sorted(set(VALUES) - set(own))
    name = data.draw(st.sampled_from(foreign))
    message = error_of({"stages": [{**base, name: data.draw(VALUES[name])}]})
    assert f"{name}=" in message and f"nor a parameter of scorer {scorer!r}" in message
    assert (f"{scorer!r} takes {', '.join(own)}" if own else f"{scorer!r} takes no parameters") in message
    assert "scorers with" in message


def test_show_prints_the_nested_form_and_only_parameters_that_act():
    snapkv = StackSpec.load("snapkv").to_yaml()
    assert "  scorer_params:\n    window: 32\n    kernel: 7\n    pooling: max\n" in snapkv
    streaming = StackSpec.load("streaming").to_yaml()
    assert "scorer_params" not in streaming and "window:" not in streaming.replace("scorer: window", "")
    obcache = StackSpec.load("obcache-kivi").to_yaml()
    assert "saliency: joint" in obcache and "kernel" not in obcache


def test_errors_name_the_field_the_value_and_what_is_allowed():
    message = error_of(evict(scorer="snapkv", kernel=4, window=0, pooling="min"))
    assert "stages.0.evict.kernel: snapkv's kernel=4 is not allowed: an odd width" in message
    assert "stages.0.evict.window: snapkv's window=0 is not allowed: Input should be greater than or equal to 1" \
        in message
    assert "stages.0.evict.pooling: snapkv's pooling='min' is not allowed: Input should be 'max' or 'avg'" in message
    message = error_of(evict(scorer="snapkv", scorer_params={"kernel": 6}))
    assert "stages.0.evict.scorer_params.kernel: snapkv's kernel=6 is not allowed" in message
    message = error_of(evict(scorer="snapkv", windw=8))
    assert "windw=8 is not allowed: neither a field of evict nor a parameter of scorer 'snapkv'" in message
    assert "did you mean 'window'" in message and "'snapkv' takes window, kernel, pooling" in message
    message = error_of(evict(scorer="obcache", scorer_params={"salience": "key"}))
    assert "scorer_params.salience" in message and "did you mean 'saliency'" in message
    message = error_of(evict(scorer="window", window=32))  # a window scorer has no observation window
    assert "'window' takes no parameters; scorers with 'window': obcache, snapkv" in message
    message = error_of(evict(scorer="snapkv", window=8, scorer_params={"window": 16}))
    assert "window is given twice" in message
    assert "a mapping ('random' takes seed)" in error_of(evict(scorer="random", scorer_params=[1]))
    message = error_of(evict(scorer="snapvk", window=8))  # the unknown scorer is the one error
    assert message.count("\n") == 1 and "did you mean 'snapkv'" in message


def test_the_budget_check_reads_the_scorer_window():
    with pytest.raises(SpecError, match=r"budget.tokens=20 is not allowed: at least .* = 4 \+ 32 = 36"):
        StackSpec.load({"budget": {"tokens": 20}, "stages": [{"kind": "evict", "scorer": "snapkv", "n_sink": 4}]})
    spec = StackSpec.load(
        {"budget": {"tokens": 20}, "stages": [{"kind": "evict", "scorer": "snapkv", "n_sink": 4,
                                               "scorer_params": {"window": 16}}]}
    )
    assert spec.stages[0].protected_count() == 20


def test_assignment_validates_and_a_new_scorer_keeps_what_it_shares():
    stage = StackSpec.load("snapkv").stages[0]
    stage.scorer_params = {"window": 16}
    assert stage.scorer_params.model_dump() == {"window": 16, "kernel": 7, "pooling": "max"}
    stage.scorer = "obcache"  # window carries over; kernel and pooling are not obcache's
    assert stage.scorer_params.model_dump() == {"window": 16, "saliency": "joint"}
    stage.scorer = "random"
    assert stage.scorer_params.model_dump() == {"seed": 0}
    with pytest.raises(ValidationError, match="not a parameter of scorer 'random'"):
        stage.scorer_params = {"window": 3}
    with pytest.raises(ValidationError, match="frozen"):
        stage.scorer_params.seed = 3
    stage.n_sink = 2  # other assignments leave the parameters alone
    assert stage.scorer_params.model_dump() == {"seed": 0}


def test_overrides_reach_scorer_parameters():
    spec = StackSpec.load("snapkv")
    assert spec.with_overrides(window=16).stages[0].scorer_params.window == 16
    switched = spec.with_overrides(scorer="obcache", saliency="key")
    assert switched.stages[0].scorer_params.model_dump() == {"window": 32, "saliency": "key"}
    assert spec.with_overrides(scorer="random", seed=3).stages[0].scorer_params.model_dump() == {"seed": 3}
    with pytest.raises(SpecError, match="seed=3 is not allowed: no stage of 'snapkv' has a field or scorer parameter"):
        spec.with_overrides(seed=3)
    with pytest.raises(SpecError, match="snapkv's kernel=2 is not allowed"):
        spec.with_overrides(kernel=2)
    assert StackSpec.load("obcache-kivi").with_overrides(window=8).stages[0].scorer_params.window == 8


def test_register_scorer_refuses_params_that_are_not_scorer_params():
    class Loose(BaseModel):
        p: int = 1

    class Bad(Scorer):
        name = "bad_params"
        Params = Loose

    with pytest.raises(TypeError, match="Bad.Params must subclass kvstack.ScorerParams"):
        register_scorer(Bad)
    assert "bad_params" not in scorer_names()


def test_a_scorer_from_outside_the_package_validates_its_parameter_and_runs(real_model_and_tokenizer):
    """tests/ext_scorer is a user's package: its scorer's own parameter loads from YAML, acts, and is validated."""
    model, tokenizer = real_model_and_tokenizer
    module = importlib.import_module("ext_scorer")
    try:
        yaml_flat = "budget: {tokens: 24}\nstages:\n  - kind: evict\n    scorer: value_pnorm\n    p: 1.0\n"
        spec = StackSpec.from_yaml(yaml_flat)
        assert isinstance(spec.stages[0].scorer_params, module.ValuePNormScorer.Params)
        assert "  scorer_params:\n    p: 1.0\n" in spec.to_yaml() and StackSpec.from_yaml(spec.to_yaml()) == spec
        nested = StackSpec.from_yaml(yaml_flat.replace("p: 1.0", "scorer_params: {p: 8.0}"))
        with pytest.raises(SpecError, match=r"stages.0.evict.p: value_pnorm's p=0.5 is not allowed: Input should be "
                                            r"greater than or equal to 1"):
            StackSpec.from_yaml(yaml_flat.replace("p: 1.0", "p: 0.5"))
        with pytest.raises(SpecError, match=r"pp=2 is not allowed: .*\(did you mean 'p'\?\); 'value_pnorm' takes p"):
            StackSpec.from_yaml(yaml_flat.replace("p: 1.0", "scorer_params: {pp: 2}"))
        assert "### `scorer: value_pnorm`" in spec_doc.render() and "Order of the value norm." in spec_doc.render()

        ids = tokenizer("Once upon a time there was a little girl who loved to play outside in the sun with her dog",
                        return_tensors="pt").input_ids
        shape = ModelShape.from_model(model)
        from transformers import DynamicCache

        from kvstack.stack.apply import cache_kwarg

        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): reference})
        values = reference.layers[0].values[0]  # [Hkv, T, D] of the unmodified model
        kept = {}
        for p, stack in ((1.0, spec), (8.0, nested)):
            cap = stack.stages[0].layer_cap(shape, model.dtype, stack.budget, 0, ids.shape[1])
            assert 0 < cap < ids.shape[1]
            with kvstack.applied(model, stack), torch.no_grad():
                cache = kvstack.cache_for(model)
                model(ids, cache=cache)
            positions = cache.layers[0].full.positions[0]  # [Hkv, cap]: head-wise
            kept[p] = [sorted(x for x in row.tolist() if x >= 0) for row in positions]
            expected = values.norm(p=p, dim=-1).topk(cap, dim=-1).indices
            assert kept[p] == [sorted(row.tolist()) for row in expected]
        assert kept[1.0] != kept[8.0]  # the parameter acts
    finally:
        unregister_scorer("value_pnorm")
    assert "value_pnorm" not in spec_doc.render()
    with pytest.raises(SpecError, match="unknown scorer 'value_pnorm'"):
        StackSpec.from_yaml(yaml_flat)
