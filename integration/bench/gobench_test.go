package bench

import (
	"reflect"
	"testing"
)

const goTestOutput = `goos: linux
goarch: amd64
pkg: github.com/llm-bulkhead/llm-bulkhead/policy
cpu: Some CPU @ 2.0GHz
BenchmarkAdmitDone-2   	 1000000	      1996 ns/op	       0 B/op	       0 allocs/op
BenchmarkAdmitDone-2   	 1000000	      2100 ns/op	       0 B/op	       0 allocs/op
BenchmarkAdmitDone-2   	 1000000	      1900 ns/op	       0 B/op	       0 allocs/op
PASS
ok  	github.com/llm-bulkhead/llm-bulkhead/policy	2.545s
pkg: github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi
BenchmarkScanRequest/llmapi/1MiB-2         	    1104	   1473927 ns/op	 711.44 MB/s	       0 B/op	       0 allocs/op
BenchmarkUsageScanner/openai_sse/event_per_write-2       	     381	   3992662 ns/op	 328.74 MB/s	      5002 writes/op	       0 B/op	       0 allocs/op
BenchmarkNoMem-16 	 500	 12.5 ns/op
BenchmarkBroken-2 	 abc	 12 ns/op
--- FAIL: BenchmarkOther
`

func TestParseGoBench(t *testing.T) {
	got := ParseGoBench([]byte(goTestOutput))
	const policyPkg = "github.com/llm-bulkhead/llm-bulkhead/policy"
	const llmapiPkg = "github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	want := []GoBench{
		{policyPkg, "BenchmarkAdmitDone", 1000000, 1996, 0, 0, -1, 1},
		{policyPkg, "BenchmarkAdmitDone", 1000000, 2100, 0, 0, -1, 1},
		{policyPkg, "BenchmarkAdmitDone", 1000000, 1900, 0, 0, -1, 1},
		{llmapiPkg, "BenchmarkScanRequest/llmapi/1MiB", 1104, 1473927, 0, 0, 711.44, 1},
		{llmapiPkg, "BenchmarkUsageScanner/openai_sse/event_per_write", 381, 3992662, 0, 0, 328.74, 1},
		{llmapiPkg, "BenchmarkNoMem", 500, 12.5, -1, -1, -1, 1},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseGoBench:\n got %+v\nwant %+v", got, want)
	}

	med := MedianGoBench(got)
	if len(med) != 4 {
		t.Fatalf("MedianGoBench gave %d benchmarks, want 4: %+v", len(med), med)
	}
	if m := med[0]; m.Name != "BenchmarkAdmitDone" || m.NsPerOp != 1996 || m.Runs != 3 || m.AllocsPerOp != 0 {
		t.Errorf("median of AdmitDone = %+v, want 1996 ns/op over 3 runs", m)
	}
	if m := med[3]; m.Name != "BenchmarkNoMem" || m.AllocsPerOp != -1 || m.Runs != 1 {
		t.Errorf("a benchmark without -benchmem keeps -1: %+v", m)
	}
}
