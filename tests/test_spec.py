"""The typed spec: loading from every source, YAML round trips, schema, and clear errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack
from kvstack import SpecError, StackSpec


def test_load_from_every_source(tmp_path):
    by_name = StackSpec.load("streaming")
    path = tmp_path / "s.yaml"
    path.write_text(by_name.to_yaml())
    assert StackSpec.load(path) == by_name
    assert StackSpec.load(str(path)) == by_name
    assert StackSpec.load(by_name.to_yaml()) == by_name
    assert StackSpec.load(by_name.model_dump()) == by_name
    assert StackSpec.load(by_name) is by_name
    python = StackSpec(name="streaming", description=by_name.description, reference=by_name.reference,
                       budget=kvstack.Budget(tokens=128), stages=[{"kind": "evict", "n_sink": 4}])
    assert python == by_name


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.one_of(st.none(), st.integers(16, 4096)),
    n_sink=st.integers(0, 8),
    recent=st.integers(0, 8),
    phase=st.sampled_from(["always", "prefill", "decode"]),
    name=st.text(min_size=1, max_size=12).filter(str.isprintable),
)
def test_yaml_round_trip(tokens, n_sink, recent, phase, name):
    stage = {"kind": "evict", "n_sink": n_sink, "recent": recent, "phase": phase}
    if tokens is not None:
        stage["budget"] = {"tokens": tokens}
    spec = StackSpec.load({"name": name, "budget": {"ratio": 0.5}, "stages": [stage]})
    again = StackSpec.load(spec.to_yaml())
    assert again == spec
    assert again.to_yaml() == spec.to_yaml()


@pytest.mark.parametrize("name", ["a\x85b", "two\nlines", "tab\t"])
def test_a_name_that_would_not_read_back_is_refused(name):
    with pytest.raises(kvstack.SpecError, match="name: one line of printable characters"):
        StackSpec.load({"name": name, "stages": []})


def test_every_preset_round_trips_and_lists():
    presets = kvstack.list_presets()
    assert {"identity", "streaming"} <= set(presets)
    for name, description in presets.items():
        spec = StackSpec.load(name)
        assert spec.name == name and description
        assert StackSpec.load(spec.to_yaml()) == spec


def test_json_schema_describes_the_stage_union():
    schema = StackSpec.model_json_schema()
    json.dumps(schema)
    assert schema["additionalProperties"] is False
    kinds = set(kvstack.stage_specs())
    assert "evict" in kinds
    text = json.dumps(schema)
    for kind in kinds:
        assert f'"{kind}"' in text


def error_of(source) -> str:
    with pytest.raises(SpecError) as info:
        StackSpec.load(source)
    return str(info.value)


def test_unknown_preset_lists_the_available_ones():
    message = error_of("no-such-preset")
    assert "unknown preset 'no-such-preset'" in message and "identity" in message and "streaming" in message


def test_unknown_stage_kind_lists_the_kinds():
    message = error_of({"stages": [{"kind": "compress-harder"}]})
    assert "stages.0" in message and "compress-harder" in message and "'evict'" in message


def test_unknown_field_is_named():
    message = error_of({"budget": {"tokens": 64}, "stages": [{"kind": "evict", "n_sinks": 4}]})
    assert "stages.0.evict.n_sinks: n_sinks=4 is not allowed" in message and "did you mean 'n_sink'" in message
    message = error_of({"stages": [{"kind": "quantize", "bitz": 4}]})  # a stage without a scorer: pydantic's words
    assert "stages.0.quantize.bitz" in message and "Extra inputs are not permitted" in message


def test_wrong_type_is_named():
    message = error_of({"budget": {"tokens": "many"}, "stages": []})
    assert "budget.tokens" in message and "'many'" in message


def test_budget_smaller_than_sinks():
    message = error_of({"budget": {"tokens": 3}, "stages": [{"kind": "evict", "n_sink": 4}]})
    assert "budget.tokens=3" in message and "n_sink" in message


def test_budget_needs_exactly_one_form():
    assert "exactly one" in error_of({"budget": {"tokens": 4, "ratio": 0.5}})
    assert "ratio" in error_of({"budget": {"ratio": 1.5}})


def test_evict_without_budget():
    assert "needs a budget" in error_of({"stages": [{"kind": "evict"}]})


def test_unknown_scorer_lists_scorers():
    message = error_of({"budget": {"tokens": 8}, "stages": [{"kind": "evict", "scorer": "vibes"}]})
    assert "vibes" in message and "window" in message


def test_invalid_yaml_names_the_line():
    text = "name: broken\nstages:\n  - kind: evict\n    n_sink: [4\n"
    message = error_of(text)
    assert "invalid YAML" in message and "line" in message


def test_yaml_that_is_not_a_mapping():
    assert "mapping" in error_of("- just\n- a list\n")


def test_missing_file(tmp_path):
    assert "does not exist" in error_of(str(tmp_path / "nope.yaml"))
