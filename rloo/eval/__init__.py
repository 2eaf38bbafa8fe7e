"""Evaluation and results: accuracy, intervals, gains, seed tables, plots and the report."""
