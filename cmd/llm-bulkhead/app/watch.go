package app

import (
	"crypto/sha256"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/llm-bulkhead/llm-bulkhead/policy/files"
)

// configMapDataLink is the symlink Kubernetes swaps to update every file of a mounted ConfigMap
// at once: policy.yaml → ..data/policy.yaml, ..data → ..2026_01_02_15_04_05.000000001.
const configMapDataLink = "..data"

// watcher calls onChange when the content of a file changes, however the change is made:
// in-place writes, delete and recreate, an editor's write-to-temp-and-rename, or a Kubernetes
// ConfigMap's symlink swap. It watches the file's directory (a watch on the file itself is lost
// when the file is replaced), debounces bursts of events, and compares content hashes so only
// real changes reload. Only events for names that can change what the path reads restart the
// debounce: a log or a cache file written steadily next to the policy would otherwise keep
// postponing the reload for as long as it is written. Safe for concurrent use.
type watcher struct {
	path     string
	dir      string
	name     string
	target   string // first name the path's symlink points through, in dir; "" if none
	debounce time.Duration
	log      *slog.Logger
	onChange func()
	fs       *fsnotify.Watcher
	done     chan struct{}
	wg       sync.WaitGroup
	last     [sha256.Size]byte
	closeMu  sync.Once
}

func newWatcher(path string, debounce time.Duration, log *slog.Logger, onChange func()) (*watcher, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	fs, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	if err := fs.Add(filepath.Dir(abs)); err != nil {
		fs.Close()
		return nil, err
	}
	w := &watcher{path: abs, dir: filepath.Dir(abs), name: filepath.Base(abs), debounce: debounce, log: log,
		onChange: onChange, fs: fs, done: make(chan struct{})}
	w.target = w.linkTarget()
	w.last = w.hash()
	w.wg.Add(1)
	go w.loop()
	return w, nil
}

// maxWatched bounds the files a watcher reads: the largest any watched path may be (a policy,
// a keys file, a TLS file). A larger one reads as deleted until it is fixed.
const maxWatched = max(files.MaxPolicy, files.MaxKeys, files.MaxPEM)

func (w *watcher) hash() [sha256.Size]byte {
	b, err := files.Read(w.path, maxWatched)
	if err != nil {
		return [sha256.Size]byte{}
	}
	return sha256.Sum256(b)
}

// linkTarget returns the name in the watched directory through which the policy path's symlink
// resolves (real.yaml for policy.yaml → real.yaml, ..data for policy.yaml → ..data/policy.yaml),
// so that replacing or editing that name counts as a change of the policy. It returns "" when the
// path is not a symlink or points outside the directory, where this watch sees nothing anyway.
func (w *watcher) linkTarget() string {
	target, err := os.Readlink(w.path)
	if err != nil {
		return ""
	}
	if !filepath.IsAbs(target) {
		target = filepath.Join(w.dir, target)
	}
	rel, err := filepath.Rel(w.dir, target)
	if err != nil {
		return ""
	}
	first, _, _ := strings.Cut(filepath.ToSlash(rel), "/")
	if first == "." || first == ".." {
		return ""
	}
	return first
}

// concerns reports whether an event for name, a path in the watched directory, can change what
// the policy path reads. An event for the path itself may re-point its symlink, so the link's
// target is read again then.
func (w *watcher) concerns(name string) bool {
	switch base := filepath.Base(name); base {
	case w.name:
		w.target = w.linkTarget()
		return true
	case configMapDataLink:
		return true
	default:
		return w.target != "" && base == w.target
	}
}

func (w *watcher) loop() {
	defer w.wg.Done()
	var timer *time.Timer
	var fire <-chan time.Time
	for {
		select {
		case <-w.done:
			if timer != nil {
				timer.Stop()
			}
			return
		case ev, ok := <-w.fs.Events:
			if !ok {
				return
			}
			if !w.concerns(ev.Name) {
				continue
			}
			// Wait for the burst (an editor's temp file and rename, a symlink swap) to settle,
			// then compare contents.
			if timer == nil {
				timer = time.NewTimer(w.debounce)
			} else {
				timer.Reset(w.debounce)
			}
			fire = timer.C
		case err, ok := <-w.fs.Errors:
			if !ok {
				return
			}
			w.log.Error("file watch error", "file", w.path, "err", err)
		case <-fire:
			fire = nil
			h := w.hash()
			if h == ([sha256.Size]byte{}) {
				// Deleted and not back yet: wait for the next event.
				continue
			}
			if h != w.last {
				w.last = h
				w.onChange()
			}
		}
	}
}

// Close stops watching and waits for the watcher's goroutine to end.
func (w *watcher) Close() {
	w.closeMu.Do(func() {
		close(w.done)
		w.fs.Close()
		w.wg.Wait()
	})
}
