// Command envsnap-peersim runs the peer tier's discrete-event model
// (bench/peersim) for one RL iteration on a cluster, without peers, with
// peers, and with peers and failing nodes, side by side, and prints the
// table docs/scale.md reports. Every input is a flag; the defaults are
// the measured numbers docs/scale.md lists.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/envsnap/envsnap/bench/peersim"
)

func main() {
	c := peersim.DefaultConfig()
	fs := flag.NewFlagSet("envsnap-peersim", flag.ExitOnError)
	peersim.Flags(fs, &c)
	fail := fs.Float64("fail", 0.01, "fraction of nodes failing mid-iteration in the failure rows")
	fs.Parse(os.Args[1:])
	rows, err := peersim.Scenarios(c, *fail)
	if err != nil {
		fmt.Fprintln(os.Stderr, "envsnap-peersim:", err)
		os.Exit(1)
	}
	fmt.Printf("envsnap-peersim %s\n\n", strings.Join(os.Args[1:], " "))
	peersim.WriteTable(os.Stdout, c, rows)
}
