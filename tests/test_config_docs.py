"""Every config field has a docstring (the one source of `--help` and the generated reference), and
the reader finds them: under the field, through inheritance, for dataclasses and pydantic models."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel, ConfigDict

from batchgen.config_docs import field_doc, field_docs, undocumented_fields
from batchgen.engine.config import EngineConfig, SpeculativeConfig
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.pipeline.config import JobConfig
from batchgen.report.config import ReportConfig
from batchgen.serve.settings import ServeConfig


def job_sections(model: type[BaseModel] = JobConfig) -> list[type[BaseModel]]:
    """JobConfig and every section model under it."""
    found = [model]
    for info in model.model_fields.values():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            found += job_sections(info.annotation)
    return found


CONFIG_CLASSES = [EngineConfig, SpeculativeConfig, SamplingParams, ReportConfig, ServeConfig, *job_sections()]


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_config_field_has_a_docstring(config_class):
    assert undocumented_fields(config_class) == []


def test_the_job_sections_are_all_checked():
    names = {section.__name__ for section in job_sections()}
    assert names >= {"JobConfig", "ModelSection", "EngineSection", "InputSection", "SamplingSection",
                     "BatchingSection", "OutputSection", "ClusterSection"}


def test_a_field_without_a_docstring_is_reported():
    @dataclasses.dataclass
    class Scratch:
        documented: int = 1
        """Has one."""
        commented: int = 2  # a comment is not a docstring
        bare: str = "x"

    assert undocumented_fields(Scratch) == ["commented", "bare"]

    class ScratchModel(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert undocumented_fields(ScratchModel) == ["bare"]
    assert ScratchModel.model_fields["documented"].description == "Has one."


def test_docstrings_are_inherited_and_a_new_field_needs_its_own():
    @dataclasses.dataclass(frozen=True)
    class Grown(EngineConfig):
        new_knob: int = 3

    docs = field_docs(Grown)
    assert docs["max_num_seqs"] == field_docs(EngineConfig)["max_num_seqs"]
    assert undocumented_fields(Grown) == ["new_knob"]


def test_the_reader_takes_the_string_right_under_a_field_only():
    @dataclasses.dataclass
    class Spaced:
        first: int = 1
        """First's,
        over two lines."""

        second: int = 2
        x = 0
        """An assignment's, not second's."""

    assert field_docs(Spaced) == {"first": "First's,\nover two lines.", "x": "An assignment's, not second's."}


def test_derived_sections_carry_their_dataclass_docstrings():
    engine = JobConfig.model_fields["engine"].annotation
    assert field_doc(engine, "max_num_seqs") == field_docs(EngineConfig)["max_num_seqs"]
    sampling = JobConfig.model_fields["sampling"].annotation
    assert field_doc(sampling, "top_p") == field_docs(SamplingParams)["top_p"]
