//go:build linux

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/docker/go-units"
	"os"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/fetch"
)

var statusCommand = &cli.Command{
	Name:  "status",
	Usage: "show the layers a running daemon serves and how much of each is fetched",
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "address", Value: daemon.DefaultAddress, Usage: "the daemon's gRPC socket (status is read from the root-only socket beside it)"},
		&cli.BoolFlag{Name: "json", Usage: "print the raw JSON status"},
	},
	Action: func(ctx context.Context, c *cli.Command) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		st, err := daemon.GetStatus(ctx, c.String("address"))
		if err != nil {
			return err
		}
		if c.Bool("json") {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(st)
		}
		w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "LAYER\tSNAPSHOTS\tENVS\tMOUNTED\tFETCHED\tFILL\tNATIVE\tSIZE\tREF")
		now := time.Now()
		for _, l := range st.Layers {
			mounted := "yes"
			switch {
			case l.Broken:
				// Retried in the background until it mounts.
				mounted = "broken"
				if l.Error != "" {
					mounted = "broken: " + l.Error
				}
			case !l.Mounted && l.Error != "":
				mounted = "error: " + l.Error
			case !l.Mounted:
				mounted = "no"
			}
			ref := l.Ref
			if n := len(l.Refs); n > 1 {
				ref = fmt.Sprintf("%s (+%d more)", ref, n-1)
			}
			native := string(l.Native)
			if native == "" {
				native = "-"
			}
			fmt.Fprintf(w, "%s\t%d\t%d\t%s\t%.1f%%\t%s\t%s\t%s\t%s\n", l.Digest.Encoded()[:12], l.Snapshots, l.Environments, mounted, l.FetchedPct,
				fillColumn(l.Fill, now), native, units.BytesSize(float64(l.BlobSize)), ref)
		}
		if err := w.Flush(); err != nil {
			return err
		}
		cs := st.Cache
		fmt.Printf("cache: %s of %s in %d chunks (%d pinned), %d hits, %d misses, %d evictions, %d corrupt\n",
			units.BytesSize(float64(cs.Size)), units.BytesSize(float64(cs.MaxBytes)), cs.Entries, cs.Pinned, cs.Hits, cs.Misses, cs.Evictions, cs.Corrupt)
		if ns := st.Native; ns != nil {
			fmt.Printf("native layer copies: %s in %d layers, %d built, %d failed, %d dropped for room\n",
				units.BytesSize(float64(ns.Size)), ns.Copies, ns.Builds, ns.Failed, ns.Reclaimed)
		}
		if us := st.Unpacked; us != nil {
			fmt.Printf("passthrough copies: %s of %s in %d files, %d opens served, %d built, %d failed, %d evicted\n",
				units.BytesSize(float64(us.Size)), units.BytesSize(float64(us.MaxBytes)), us.Entries, us.Hits, us.Builds, us.Failed, us.Evicted)
		}
		if ps := st.Peers; ps != nil {
			fmt.Printf("peers: %d members, %d bad now; fetched %s from peers, served %s to peers (%d requests, %d refused, %d busy); %d requests to owners, hit ratio %.2f, %d hedges, %d bad marks\n",
				ps.Members, ps.BadPeers, units.BytesSize(float64(ps.FetchedBytes)), units.BytesSize(float64(ps.ServedBytes)), ps.Served, ps.Refused, ps.Busy,
				ps.Requests, ps.HitRatio, ps.Hedges, ps.BadMarks)
		}
		return nil
	},
}

// fillColumn says what a layer's fill does; a held one, for what and how
// long (docs/snapshotter.md lists the reasons).
func fillColumn(f fetch.FillStatus, now time.Time) string {
	if f.State == fetch.FillHeld {
		return fmt.Sprintf("held: %s %s", f.Hold, now.Sub(f.Since).Round(time.Second))
	}
	return f.State.String()
}

func init() { commands = append(commands, statusCommand) }
