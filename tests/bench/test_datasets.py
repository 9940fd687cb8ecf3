"""The benches' prompt sets: a file dataset without its file says how to run with none."""

from __future__ import annotations

import pytest

from pagedserve.bench.datasets import DatasetError, DatasetSpec, sample_requests


def test_a_file_dataset_without_its_file_names_the_flag_and_the_set_that_needs_none(tmp_path):
    for path in (None, tmp_path / "missing.json"):
        with pytest.raises(DatasetError, match=r"--dataset-path must name the sharegpt file .*--dataset-name random, "
                                               r"which needs no file"):
            sample_requests(DatasetSpec("sharegpt", path, num_prompts=4), tokenizer=None)
