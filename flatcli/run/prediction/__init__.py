"""Prediction: what a run will spend before it runs, and how a budget is divided.

The measures declare their costs (`flatcli.measures.MeasureSpec.estimate`, composed from the
estimators' declarations, `flatcli.engine.linalg.Cost`); this package turns them into seconds
(`predict`, from the products timed on the model, `timing`), peak memory (`memory`), the shares
of a budget (`shares`) and their spending while the run goes (`budgeting`), and the dry run's
report (`dry_run`, `flatcli.api.estimate_costs`)."""
