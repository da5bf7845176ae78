"""scripts/ncu-rank-launches.py, which picks the launches of one `bench gemm --rs-ranks` process
to sample from Nsight Compute's CSV listing: the build alone (the plain entry), the order row and
the rank row (the routed entry's lower and higher DRAM reads), or the rank row alone where the
order row runs another entry."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ncu-rank-launches.py"


def listing(tmp_path, launches):
    """A listing as `ncu --csv --log-file` writes one: a metric a line, (name, DRAM bytes read)
    for each launch, IDs from 0."""
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, (name, reads) in enumerate(launches):
        lines.append(f'"{i}","{name}","dram__bytes_read.sum","byte","{reads:,}"')
        lines.append(f'"{i}","{name}","gpu__time_duration.sum","ns","600000"')
    path = tmp_path / "list.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def picks(tmp_path, launches):
    path = listing(tmp_path, launches)
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), str(tmp_path / "table.txt")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "table.txt").read_text().splitlines()) == len(launches)
    return dict(line.split() for line in done.stdout.splitlines())


def test_order_and_rank_rows_of_one_routed_entry_split_by_their_reads(tmp_path):
    plain, routed = "gemm_direct_bf16_nk_bf16_plain", "gemm_direct_bf16_nk_bf16_routed"
    got = picks(tmp_path, [(plain, 600e6), (plain, 602e6), (routed, 650e6), (routed, 720e6),
                           (routed, 651e6), (routed, 719e6)])
    assert got == {"plain": "1", "order": "4", "rank": "5"}


def test_the_rank_row_alone_where_the_order_row_runs_the_general_entry(tmp_path):
    # the wide ping-pong build: its order row runs the general entry, its rank row the routed
    # one, each launch of which reads the partial beside what the build alone reads
    plain, general, routed = ("gemm_ping_pong_wide_bf16_nk_bf16_plain", "gemm_ping_pong_wide_bf16_nk_bf16",
                              "gemm_ping_pong_wide_bf16_nk_bf16_routed")
    got = picks(tmp_path, [(plain, 600e6), (general, 610e6), (routed, 720e6), (plain, 601e6),
                           (general, 611e6), (routed, 721e6)])
    assert got == {"plain": "3", "rank": "5"}


def test_no_rank_row_where_the_routed_reads_are_the_plain_ones(tmp_path):
    plain, routed = "gemm_direct_bf16_nk_bf16_plain", "gemm_direct_bf16_nk_bf16_routed"
    got = picks(tmp_path, [(plain, 600e6), (routed, 601e6), (routed, 602e6)])
    assert got == {"plain": "0"}


def test_the_rank_rows_reads_spread_by_launch_are_one_group(tmp_path):
    # the wide build's rank row alone among the routed launches, its reads spread over 5 % in
    # steps of under 3 %: no order row is made of its lower half
    plain, general, routed = ("gemm_ping_pong_wide_bf16_nk_bf16_plain", "gemm_ping_pong_wide_bf16_nk_bf16",
                              "gemm_ping_pong_wide_bf16_nk_bf16_routed")
    launches = [(plain, 630e6), (general, 640e6)]
    launches += [(routed, r * 1e6) for r in (689, 712, 698, 724, 703, 706)]
    got = picks(tmp_path, launches)
    assert got == {"plain": "0", "rank": "7"}
