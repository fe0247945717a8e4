"""What a run writes for people: results files and tables (`results`), figures (`plots`), what both read off the
evaluations (`axes`), model cards (`model_card`, template in `templates/`) and the Hub push (`publish`)."""
