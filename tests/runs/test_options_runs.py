"""The script's own process: `mnist_ddp.py --help` lists neither the testing aid
(--interrupt-at) nor --cuda-graphs, and an abbreviation of an option exits 2 with one line.
ddpkit/options.py at unit level: tests/unit/test_options.py.

    python -m pytest tests/runs/test_options_runs.py
"""



from helpers.processes import run_single


def test_the_script_s_help_lists_neither_interrupt_at_nor_cuda_graphs_and_an_abbreviation_exits_2(tmp_path):
    helped = run_single(["--help"], tmp_path)
    assert helped.returncode == 0 and "--max-steps" in helped.stdout, helped.stderr[-2000:]
    assert "--interrupt-at" not in helped.stdout and "--cuda-graphs" not in helped.stdout
    for abbreviation in (["--ep", "3"], ["--run-n", "x"]):
        refused = run_single(abbreviation, tmp_path)
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stdout[-2000:]
        assert refused.stderr == f"mnist_ddp.py: error: unrecognized arguments: {' '.join(abbreviation)} (see --help)\n"
