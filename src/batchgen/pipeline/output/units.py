"""Work units: (input file, row range) pieces of a job, each giving one deterministically named output file."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.pipeline.input_file import InputFile


@dataclass(frozen=True)
class WorkUnit:
    index: int  # position in the job's plan; names the output file
    file: InputFile
    start: int  # first input row (within the file)
    stop: int  # one past the last input row

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def output_name(self) -> str:
        return unit_file_name(self.index)


def unit_file_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def plan_units(files: list[InputFile], rows_per_unit: int, limit: int | None = None) -> list[WorkUnit]:
    """Cut each file (in the given sorted order) into ranges of `rows_per_unit` rows.

    Units never span files, so a unit's rows come from one footer and one output file maps to one
    input range. `limit` keeps only the first `limit` rows of the whole input.
    """
    units: list[WorkUnit] = []
    num_left = limit if limit is not None else float("inf")
    for file in files:
        start = 0
        while start < file.num_rows and num_left > 0:
            stop = int(min(start + rows_per_unit, file.num_rows, start + num_left))
            units.append(WorkUnit(len(units), file, start, stop))
            num_left -= stop - start
            start = stop
    return units


def contiguous_runs(units: list[WorkUnit]) -> list[list[WorkUnit]]:
    """Group pending units into runs that are adjacent in one file, so each run is one sequential read."""
    runs: list[list[WorkUnit]] = []
    for unit in units:
        last = runs[-1][-1] if runs else None
        if last is not None and last.file.path == unit.file.path and last.stop == unit.start:
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return runs
