package policy

// GlobMatch exposes the model-map glob to tests.
var GlobMatch = globMatch
