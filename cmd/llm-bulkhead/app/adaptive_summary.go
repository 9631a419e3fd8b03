package app

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// explainAdaptive prints the compartments whose concurrency limit is learned (max_concurrent:
// adaptive): their bounds and settings, and what moves the limit.
func explainAdaptive(w io.Writer, compartments []policy.CompartmentView) {
	var adaptive []policy.CompartmentView
	for _, cv := range compartments {
		if cv.Adaptive != nil {
			adaptive = append(adaptive, cv)
		}
	}
	if len(adaptive) == 0 {
		return
	}
	fmt.Fprintln(w, "\nAdaptive limits (learned from time to first token per prompt size, inter-token latency and upstream 429/503/timeouts; docs/adaptive.md):")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  NAME\tINITIAL\tMIN\tMAX\tTOLERANCE\tINTERVAL\tREMEASURE")
	for _, cv := range adaptive {
		a := cv.Adaptive
		fmt.Fprintf(tw, "  %s\t%d\t%d\t%d\t%g\t%s\t%s\n", cv.Name, a.Initial, a.Min, a.Max, a.Tolerance, a.Interval, a.RemeasureInterval)
	}
	tw.Flush()
	fmt.Fprintln(w, "  The limit shrinks when a signal exceeds tolerance × its no-load baseline or the provider says to back off, grows while saturated")
	fmt.Fprintln(w, "  with healthy latency, and is held at min every remeasure interval to measure the baselines again. Each replica learns its own.")
}
