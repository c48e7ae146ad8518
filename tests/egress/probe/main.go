// Command probe is what the egress end-to-end test runs on both sides of
// an environment's network: `serve` answers on TCP and UDP ports, `check`
// tries destinations, `scan` looks for open TCP ports. Built static and
// added to a busybox image.
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Greeting is what a probe server (and the test's own listeners) write
// on every TCP connection: a connection that reads it reached a server.
const Greeting = "envsnap-egress-ok"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: probe serve tcp:PORT|udp:PORT... | check [-hold DUR] tcp|udp:HOST:PORT... | scan HOST LO-HI...")
		os.Exit(2)
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "serve":
		serve(args)
	case "run":
		run(args)
	default:
		fmt.Fprintf(os.Stderr, "unknown mode %s\n", os.Args[1])
		os.Exit(2)
	}
}

func serve(specs []string) {
	for _, s := range specs {
		// tcp:PORT, udp:ADDR:PORT (a UDP reply leaves from the address
		// the request went to only when the socket is bound to it).
		proto, addr, _ := strings.Cut(s, ":")
		if !strings.Contains(addr, ":") {
			addr = ":" + addr
		}
		switch proto {
		case "tcp":
			l, err := net.Listen("tcp", addr)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					fmt.Fprintln(c, Greeting)
					c.Close()
				}
			}()
		case "udp":
			pc, err := net.ListenPacket("udp", addr)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			go func() {
				buf := make([]byte, 1500)
				for {
					n, addr, err := pc.ReadFrom(buf)
					if err != nil {
						return
					}
					_, _ = pc.WriteTo(buf[:n], addr)
				}
			}()
		}
	}
	fmt.Println("serving")
	select {}
}

// run checks each argument: "tcp:HOST:PORT" or "udp:HOST:PORT" prints
// "open ARG" or "denied ARG: why"; "scan:HOST:LO-HI" prints
// "scan HOST:LO-HI open P,P,...". "hold:DUR" sleeps after "done".
func run(args []string) {
	var hold time.Duration
	for _, a := range args {
		kind, rest, _ := strings.Cut(a, ":")
		switch kind {
		case "tcp", "udp":
			if err := try(kind, rest); err != nil {
				fmt.Printf("denied %s: %v\n", a, err)
			} else {
				fmt.Printf("open %s\n", a)
			}
		case "scan":
			host, ports, _ := strings.Cut(rest, ":")
			lo, hi, _ := strings.Cut(ports, "-")
			l, _ := strconv.Atoi(lo)
			h, _ := strconv.Atoi(hi)
			fmt.Printf("scan %s open %s\n", rest, scan(host, l, h))
		case "hold":
			hold, _ = time.ParseDuration(rest)
		}
	}
	fmt.Println("done")
	time.Sleep(hold)
}

func try(proto, addr string) error {
	c, err := net.DialTimeout(proto, addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if proto == "udp" {
		if _, err := c.Write([]byte(Greeting)); err != nil {
			return err
		}
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != Greeting {
			return fmt.Errorf("unexpected reply %q", buf[:n])
		}
		return nil
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != Greeting {
		return fmt.Errorf("unexpected greeting %q", line)
	}
	return nil
}

// scan returns the TCP ports of host in [lo, hi] that accept a connection.
func scan(host string, lo, hi int) string {
	var (
		mu   sync.Mutex
		open []int
		wg   sync.WaitGroup
		sem  = make(chan struct{}, 64)
	)
	for p := lo; p <= hi; p++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(p int) {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(p)), time.Second)
			if err != nil {
				return
			}
			c.Close()
			mu.Lock()
			open = append(open, p)
			mu.Unlock()
		}(p)
	}
	wg.Wait()
	sort.Ints(open)
	s := make([]string, len(open))
	for i, p := range open {
		s[i] = strconv.Itoa(p)
	}
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}
