package app

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCgroupMemoryLimit reads a container's memory limit from cgroup v2 and v1 trees laid out
// as the kernel does, under the process's cgroup path or at the hierarchy's root (a container
// with its own cgroup namespace), and finds none where there is none.
func TestCgroupMemoryLimit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		self  string
		files map[string]string
		want  int64
	}{
		{"v2 at the root (own namespace)", "0::/\n", map[string]string{"memory.max": "536870912\n"}, 512 << 20},
		{"v2 under the process's path", "0::/kubepods/pod1/c1\n", map[string]string{"kubepods/pod1/c1/memory.max": "268435456\n", "memory.max": "max\n"}, 256 << 20},
		{"v2 without a limit", "0::/\n", map[string]string{"memory.max": "max\n"}, 0},
		{"v1 under the process's path", "4:memory:/docker/abc\n1:cpu:/\n", map[string]string{"memory/docker/abc/memory.limit_in_bytes": "1073741824\n"}, 1 << 30},
		{"v1 with other controllers in the line", "5:cpuacct,memory:/\n", map[string]string{"memory/memory.limit_in_bytes": "1048576\n"}, 1 << 20},
		{"v1 unlimited", "4:memory:/\n", map[string]string{"memory/memory.limit_in_bytes": "9223372036854771712\n"}, 0},
		{"nothing readable", "0::/\n", nil, 0},
		{"garbage", "0::/\n", map[string]string{"memory.max": "lots\n"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			self := filepath.Join(dir, "cgroup")
			if err := os.WriteFile(self, []byte(tc.self), 0o644); err != nil {
				t.Fatal(err)
			}
			root := filepath.Join(dir, "sys")
			for name, content := range tc.files {
				path := filepath.Join(root, name)
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if got := cgroupMemoryLimit(self, root); got != tc.want {
				t.Errorf("limit %d, want %d", got, tc.want)
			}
		})
	}
}
