package arbiter

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// WriteEnvTable prints environments as a table: limits, usage and the
// controller's counters.
func WriteEnvTable(w io.Writer, envs []EnvInfo) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ENV\tCPU\tCPU USED\tTHROTTLED\tMEMORY\tWORKING SET\tGROWS\tSHRINKS\tOOMS\tSTATE\tAGE")
	for _, e := range envs {
		var st envlet.Status
		if len(e.Status) > 0 {
			_ = json.Unmarshal(e.Status, &st)
		}
		state := "running"
		switch {
		case !e.Ended.IsZero():
			state = "ended: " + e.Reason
		case st.Paused && st.PushedOut > 0:
			state = "paused, " + envlet.FormatBytes(st.PushedOut) + " pushed out"
		case st.Paused:
			state = "paused"
		case st.Idle:
			state = "idle"
		}
		end := time.Now()
		if !e.Ended.IsZero() {
			end = e.Ended
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%.0f%%\t%s\t%s\t%d/%d\t%d/%d\t%d\t%s\t%s\n",
			e.Env, e.Current.CPU, e.Used.CPU, 100*st.Throttled,
			envlet.FormatBytes(e.Current.Memory), envlet.FormatBytes(e.Used.Memory),
			st.CPUGrows, st.MemGrows, st.CPUShrinks, st.MemShrinks, st.OOMs, state,
			end.Sub(e.Admitted).Truncate(time.Second))
	}
	return tw.Flush()
}

// TimelineCSVHeader is the first row WriteTimelineCSV writes.
var TimelineCSVHeader = []string{"time", "t_seconds", "cpu_limit", "memory_limit", "cpu_used", "throttled", "working_set", "memory_usage", "wake", "actions"}

// WriteTimelineCSV writes a controller timeline (as the arbiter stores it)
// as CSV, one row per tick, t_seconds counted from the first point.
func WriteTimelineCSV(w io.Writer, points []json.RawMessage) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(TimelineCSVHeader); err != nil {
		return err
	}
	var t0 time.Time
	for i, raw := range points {
		var p envlet.TimelinePoint
		if err := json.Unmarshal(raw, &p); err != nil {
			return fmt.Errorf("timeline point %d: %w", i, err)
		}
		if i == 0 {
			t0 = p.T
		}
		f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
		d := func(v int64) string { return strconv.FormatInt(v, 10) }
		if err := cw.Write([]string{
			p.T.UTC().Format(time.RFC3339Nano), f(p.T.Sub(t0).Seconds()),
			f(p.Limit.CPU), d(p.Limit.Memory), f(p.CPUUsed), f(p.Throttled),
			d(p.WS), d(p.MemUsage), p.Wake, p.Actions,
		}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}
