"""`tandem dashboard`: a local, read-only web page over the runs and evals under an outputs directory."""
