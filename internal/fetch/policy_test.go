package fetch

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// TestFillPolicyDecide: the admission rule at single moments, from the
// foreground activity as values.
func TestFillPolicyDecide(t *testing.T) {
	p := DefaultFillPolicy()
	now := time.Unix(1000, 0)
	long := 10 * time.Second
	ago := func(d time.Duration) time.Time { return now.Add(-d) }
	for _, tt := range []struct {
		name             string
		fg               Foreground
		held             time.Duration
		worker0, workerN FillHold
	}{
		{name: "idle node", fg: Foreground{LastWait: ago(long), LastMount: ago(long), LastRead: ago(long)}},
		{name: "never any activity", fg: Foreground{}},
		{name: "foreground read waiting", fg: Foreground{Waiting: 1, LastWait: ago(long), LastMount: ago(long), LastRead: ago(long)},
			worker0: HoldWaiting, workerN: HoldWaiting},
		{name: "prefetch running", fg: Foreground{Prefetching: 1, LastWait: ago(long), LastMount: ago(long), LastRead: ago(long)},
			worker0: HoldPrefetch, workerN: HoldPrefetch},
		{name: "just mounted", fg: Foreground{LastWait: ago(long), LastMount: now, LastRead: now},
			worker0: HoldMount, workerN: HoldMount},
		{name: "mounted a while ago, no read yet", fg: Foreground{LastWait: ago(long), LastMount: ago(p.AfterMount / 2), LastRead: ago(p.AfterMount / 2)},
			worker0: HoldMount, workerN: HoldMount},
		{name: "network wait just ended", fg: Foreground{LastWait: ago(p.Quiet / 2), LastMount: ago(long), LastRead: ago(long)},
			worker0: HoldQuiet, workerN: HoldQuiet},
		{name: "quiet, cache hits recent", fg: Foreground{LastWait: ago(2 * p.Quiet), LastMount: ago(long), LastRead: ago(p.Calm / 2)},
			workerN: HoldCalm},
		{name: "quiet, reads long ago", fg: Foreground{LastWait: ago(2 * p.Quiet), LastMount: ago(long), LastRead: ago(2 * p.Calm)}},
		{name: "file system in use during a start", fg: Foreground{LastWait: ago(long), LastMount: ago(p.Startup / 2), LastOp: now, LastRead: ago(long)},
			worker0: HoldStartup, workerN: HoldStartup},
		{name: "file system in use long after the mounts", fg: Foreground{LastWait: ago(long), LastMount: ago(2 * p.Startup), LastOp: now, LastRead: ago(long)}},
		{name: "busy but held too long", fg: Foreground{Waiting: 1, LastWait: now, LastMount: now, LastRead: now}, held: p.MaxPause,
			workerN: HoldWaiting},
		{name: "held too long, but another layer forced a batch lately", held: p.MaxPause,
			fg:      Foreground{Waiting: 1, LastWait: now, LastMount: now, LastRead: now, LastForced: ago(p.MaxPause / 2)},
			worker0: HoldWaiting, workerN: HoldWaiting},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := p.Decide(now, tt.fg, 0, ago(tt.held)); got.Hold != tt.worker0 {
				t.Errorf("first worker: %v, want %v", got.Hold, tt.worker0)
			}
			if got := p.Decide(now, tt.fg, 1, ago(tt.held)); got.Hold != tt.workerN {
				t.Errorf("other workers: %v, want %v", got.Hold, tt.workerN)
			}
		})
	}
}

// fgEvent is one foreground event of a trace, at a time after its start.
type fgEvent struct {
	at   time.Duration
	kind string // mount, op, read, wait (a network wait begins), waited (it ends)
}

// replayFill runs one fill worker against a trace on a fake clock, the
// way Flights.yieldFill does: decide, and when held look again at Until
// (or at the next event, which may change the answer only by holding
// longer). Every batch takes batch. It returns the decisions until end,
// as "t=<ms> <hold>": every send, and each change of the reason to hold.
func replayFill(t *testing.T, p FillPolicy, w int, events []fgEvent, batch, end time.Duration) []string {
	t.Helper()
	t0 := time.Unix(1000, 0)
	var fg Foreground
	next := 0
	apply := func(upTo time.Duration) {
		for ; next < len(events) && events[next].at <= upTo; next++ {
			at := t0.Add(events[next].at)
			switch events[next].kind {
			case "mount":
				fg.LastMount, fg.LastRead = at, at
			case "op":
				fg.LastOp = at
			case "read":
				fg.LastRead = at
			case "wait":
				fg.Waiting++
				fg.LastRead = at
			case "waited":
				fg.Waiting--
				fg.LastWait = at
			default:
				t.Fatalf("unknown event %q", events[next].kind)
			}
		}
	}
	var out []string
	now := time.Duration(0)
	held := now
	last := FillSend
	for now < end {
		apply(now)
		d := p.Decide(t0.Add(now), fg, w, t0.Add(held))
		if d.Send() || d.Hold != last {
			out = append(out, fmt.Sprintf("t=%d %v", now.Milliseconds(), d.Hold))
		}
		last = d.Hold
		if d.Forced {
			fg.LastForced = t0.Add(now)
		}
		if d.Send() {
			now += batch
			held = now
			continue
		}
		if !d.Until.After(t0.Add(now)) {
			t.Fatalf("t=%v: held (%v) until %v, not later than now", now, d.Hold, d.Until.Sub(t0))
		}
		wake := d.Until.Sub(t0)
		if next < len(events) && events[next].at < wake {
			wake = events[next].at
		}
		now = wake
	}
	return out
}

// TestFillPolicyTraces replays container starts against the fill and
// asserts the exact decisions: when each batch goes out, and why it waits
// otherwise.
func TestFillPolicyTraces(t *testing.T) {
	p := DefaultFillPolicy()
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	for _, tt := range []struct {
		name   string
		worker int
		events []fgEvent
		batch  time.Duration
		end    time.Duration
		want   []string
	}{{
		// Two mounts, set-up with no reads, a start that waits on the
		// network once and does file-system work in two bursts: the fill
		// starts once mounts and the wait are AfterMount and Quiet behind
		// it, and holds again for the second burst.
		name: "container start", worker: 0, batch: ms(100), end: ms(1800),
		events: []fgEvent{
			{0, "mount"}, {ms(50), "mount"},
			{ms(450), "op"}, {ms(500), "wait"}, {ms(540), "waited"}, {ms(600), "op"},
			{ms(1200), "op"}, {ms(1250), "read"},
		},
		want: []string{
			"t=0 mount", "t=500 waiting", "t=540 quiet", "t=1050 send", "t=1150 send",
			"t=1250 startup", "t=1500 send", "t=1600 send", "t=1700 send",
		},
	}, {
		// The other workers also wait for reads to calm down, and look
		// again only when every reason has passed.
		name: "second worker waits for calm", worker: 1, batch: ms(500), end: ms(4000),
		events: []fgEvent{{0, "mount"}, {ms(1250), "read"}},
		want:   []string{"t=0 mount", "t=1250 calm", "t=3250 send", "t=3750 send"},
	}, {
		// A read stuck on the network: the first worker sends one batch
		// every MaxPause anyway.
		name: "stuck read cannot starve the fill", worker: 0, batch: ms(100), end: ms(5000),
		events: []fgEvent{{0, "wait"}},
		want:   []string{"t=0 waiting", "t=2000 send", "t=2100 waiting", "t=4100 send", "t=4200 waiting"},
	}, {
		name: "stuck read holds the other workers", worker: 1, batch: ms(100), end: ms(5000),
		events: []fgEvent{{0, "wait"}},
		want:   []string{"t=0 waiting"},
	}} {
		t.Run(tt.name, func(t *testing.T) {
			got := replayFill(t, p, tt.worker, tt.events, tt.batch, tt.end)
			if !slices.Equal(got, tt.want) {
				t.Errorf("decisions:\n got %q\nwant %q", got, tt.want)
			}
		})
	}
}

// TestForcedBatchNodeWide: two layers' fills held back by a read stuck on
// the network get one forced batch per MaxPause between them, not one
// each.
func TestForcedBatchNodeWide(t *testing.T) {
	p := DefaultFillPolicy()
	p.MaxPause, p.Poll = 300*time.Millisecond, 5*time.Millisecond
	f := NewFlights(WithFillPolicy(p))
	f.waiting.Store(1) // a read waits on the network for the whole test
	start := time.Now()
	got := make(chan time.Duration, 2)
	for range 2 {
		go func() {
			if err := f.yieldFill(context.Background(), 0, nil); err != nil {
				t.Error(err)
			}
			got <- time.Since(start)
		}()
	}
	first, second := <-got, <-got
	if first < p.MaxPause {
		t.Errorf("first forced batch after %v, before MaxPause %v", first, p.MaxPause)
	}
	if second-first < p.MaxPause-p.Poll {
		t.Errorf("forced batches %v and %v apart; want at least MaxPause %v between them", first, second, p.MaxPause)
	}
}
