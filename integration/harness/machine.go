package harness

import (
	"os"
	"strings"
)

// LoadAverage returns the machine's 1-, 5- and 15-minute load averages as /proc/loadavg writes
// them ("1.07 0.92 0.88"), or "" where that file does not exist. Experiments report it because
// the machines they run on are shared.
func LoadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
