"""Benchmark suites, each named by the question it answers, over the measuring code in tools/.

`python -m benchmarks list` names them; `run SUITE` writes one JSON result file, `report` turns
result files into markdown tables, `compare A B` puts two results side by side with ratios.
"""
