//go:build linux

package main

import (
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/fetch"
)

// TestFillColumn: a held fill says what it waits for and how long; any
// other state is its name.
func TestFillColumn(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		st   fetch.FillStatus
		want string
	}{
		{fetch.FillStatus{State: fetch.FillHeld, Hold: fetch.HoldMount, Since: now.Add(-7200 * time.Millisecond)}, "held: mount 7s"},
		{fetch.FillStatus{State: fetch.FillHeld, Hold: fetch.HoldWaiting, Since: now}, "held: waiting 0s"},
		{fetch.FillStatus{State: fetch.FillRunning, Since: now.Add(-time.Minute)}, "running"},
		{fetch.FillStatus{State: fetch.FillCacheFull}, "cache full"},
		{fetch.FillStatus{}, "pending"},
	} {
		if got := fillColumn(tc.st, now); got != tc.want {
			t.Errorf("fillColumn(%+v) = %q, want %q", tc.st, got, tc.want)
		}
	}
}
