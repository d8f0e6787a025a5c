"""The parts of benchmarks/traced.py (its docstring describes them); traced.py runs them."""

__all__: list = []
