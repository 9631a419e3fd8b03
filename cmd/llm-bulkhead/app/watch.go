package app

import (
	"crypto/sha256"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
)

// watcher calls onChange when the content of a file changes, however the change is made:
// in-place writes, delete and recreate, an editor's write-to-temp-and-rename, or a Kubernetes
// ConfigMap's symlink swap. It watches the file's directory (a watch on the file itself is lost
// when the file is replaced), debounces bursts of events, and compares content hashes so only
// real changes reload. Safe for concurrent use.
type watcher struct {
	path     string
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
	w := &watcher{path: abs, debounce: debounce, log: log, onChange: onChange, fs: fs, done: make(chan struct{})}
	w.last = w.hash()
	w.wg.Add(1)
	go w.loop()
	return w, nil
}

func (w *watcher) hash() [sha256.Size]byte {
	b, err := os.ReadFile(w.path)
	if err != nil {
		return [sha256.Size]byte{}
	}
	return sha256.Sum256(b)
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
		case _, ok := <-w.fs.Events:
			if !ok {
				return
			}
			// Any event in the directory may be our file changing (a symlink swap changes a
			// sibling): wait for the burst to settle, then compare contents.
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
			w.log.Error("policy file watch error", "err", err)
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
