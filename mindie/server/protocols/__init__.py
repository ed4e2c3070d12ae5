"""One adapter module per API family: each parses its bodies into a `Generation` and renders
engine outputs back in its own shapes; `common` holds what they share."""
