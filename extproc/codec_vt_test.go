//go:build vtprotobuf

package extproc

import "testing"

// TestFastMarshalCompiledIn: built with -tags vtprotobuf (as make and the Dockerfile build),
// the replies have generated marshalling; a go-control-plane without it would silently fall
// back to reflection.
func TestFastMarshalCompiledIn(t *testing.T) {
	if !FastMarshal() {
		t.Fatal("built with -tags vtprotobuf, but ProcessingResponse has no generated marshalling")
	}
}
