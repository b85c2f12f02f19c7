"""``polytrain compare``: one model, data and budget trained with several strategies, with and without
stragglers, in one run; a table (text, Markdown, JSON) and a plot of loss against time and examples."""

from polytrain.compare.report import document, format_markdown, format_text, plot, rows
from polytrain.compare.runner import Case, Outcome, available, check_cases, plan_cases, read_outcome, run_cases
from polytrain.compare.specs import DEFAULT_STRATEGIES, CompareConfig, StrategySpec, parse_spec, parse_specs

__all__ = ["DEFAULT_STRATEGIES", "Case", "CompareConfig", "Outcome", "StrategySpec", "available", "check_cases",
           "document", "format_markdown", "format_text", "parse_spec", "parse_specs", "plan_cases", "plot",
           "read_outcome", "rows", "run_cases"]
