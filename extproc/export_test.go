package extproc

import extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

// SetBeforeHandle installs a function run before each message is handled (tests only).
func (s *Server) SetBeforeHandle(f func(*extprocv3.ProcessingRequest)) { s.beforeHandle = f }
