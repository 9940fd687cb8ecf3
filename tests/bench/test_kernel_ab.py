"""kernel_ab: the base side of the same-process A/B scripts reads a revision's kernel folder and renames its library."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.bench.kernel_ab import files_at, files_in_tree, renamed_library
from pagedserve.engine.models.onednn import FEW_ROWS_SOURCE


def test_a_revisions_kernel_folder_holds_the_source_and_the_headers_it_includes():
    files = files_at("HEAD", FEW_ROWS_SOURCE.parent)
    assert {"few_rows_bf16.cpp", "panel_gemm_f32.cpp", "l2_prefetch.h"} <= set(files)
    assert '#include "l2_prefetch.h"' in files["few_rows_bf16.cpp"]
    assert set(files) <= set(files_in_tree(FEW_ROWS_SOURCE.parent))


def test_an_unknown_revision_or_foreign_library_lines_stop_with_what_to_fix():
    with pytest.raises(SystemExit, match="no-such-revision"):
        files_at("no-such-revision", FEW_ROWS_SOURCE.parent)
    source = "TORCH_LIBRARY(other, m) {}\nTORCH_LIBRARY_IMPL(other, CPU, m) {}\n"
    with pytest.raises(SystemExit, match="the kernel at X: its TORCH_LIBRARY lines are not pagedserve_gemm's"):
        renamed_library({"k.cpp": source}, Path("k.cpp"), "pagedserve_gemm", "base", "the kernel at X")
    with pytest.raises(SystemExit, match="there is no k.cpp"):
        renamed_library({}, Path("k.cpp"), "pagedserve_gemm", "base", "the kernel at X")
